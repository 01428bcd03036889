"""The per-client token bucket: a burst at once, then the rate; clients apart; memory bounded."""

from __future__ import annotations

import pytest

from services.gateway.core.rates import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_and_each_client_its_own_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)  # one request per 0.5 s from now on
    assert limiter.take("b") == 0.0  # another client is not held up
    clock.now = 0.5
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == pytest.approx(0.5)
    clock.now = 100.0  # idle for long: a full burst again, never more
    assert [limiter.take("a") for _ in range(4)][-1] > 0.0


def test_refused_requests_do_not_spend_and_memory_stays_bounded() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=1, clients=100, clock=clock)
    assert limiter.take("a") == 0.0
    for _ in range(10):  # hammering while refused does not push the next slot further away
        assert limiter.take("a") == pytest.approx(1.0)
    clock.now = 1.0
    assert limiter.take("a") == 0.0
    for i in range(1000):
        limiter.take(f"flood-{i}")
    assert len(limiter.buckets) == 100


def test_nonsense_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate=0.0, burst=1)
    with pytest.raises(ValueError):
        RateLimiter(rate=1.0, burst=0)
