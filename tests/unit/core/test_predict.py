"""A placement's predicted speed (``libs/core/predict.py``): memory-bound at one stream,
compute-bound at many, each hop paying its round trips; and corrected by what one placement
measured, for its own devices and, by default, for the others."""

from __future__ import annotations

import pytest

from libs.core.catalogue import ModelSpec
from libs.core.predict import TRIPS_PER_STEP, Stage, corrected, predict, step_s

# 16 layers of 25 M parameters, one byte each (Q8): 0.4 GB of layers, 50 GFLOP per token.
MODEL = ModelSpec("m", 16, 25e6, 1e6, 1e6, 1.0, 1000.0, runtime_overhead_gb=0.0)


def whole(device: str = "a", gflops: float = 100.0, bandwidth: float = 10.0) -> list[Stage]:
    return [Stage(device, 0, 16, gflops, bandwidth)]


def test_one_stream_is_bound_by_reading_the_weights_and_many_by_computing() -> None:
    one = step_s(MODEL, whole(), 1)
    assert step_s(MODEL, whole(bandwidth=20.0), 1) == pytest.approx(one / 2, rel=0.01)
    assert step_s(MODEL, whole(gflops=200.0), 1) == pytest.approx(one)  # not compute-bound
    rates = predict(MODEL, whole(), (1, 8, 64)).tokens_per_s
    assert rates[1] < rates[8] == pytest.approx(rates[64])  # more streams: up to compute's cap
    # at 64 streams compute binds: twice the GFLOP/s, about twice the rate
    assert predict(MODEL, whole(gflops=200.0), (64,)).tokens_per_s[64] == pytest.approx(
        2 * rates[64], rel=0.05
    )


def test_each_stage_after_the_first_pays_its_links_round_trips() -> None:
    near = [Stage("a", 0, 8, 100.0, 10.0), Stage("b", 8, 16, 100.0, 10.0, rtt_ms=0.0)]
    far = [Stage("a", 0, 8, 100.0, 10.0), Stage("b", 8, 16, 100.0, 10.0, rtt_ms=20.0)]
    added = step_s(MODEL, far) - step_s(MODEL, near)
    assert added == pytest.approx(TRIPS_PER_STEP * 0.020)
    assert predict(MODEL, far).ttft_ms > predict(MODEL, near).ttft_ms


def test_a_measured_placement_corrects_its_devices_and_the_default_for_the_others() -> None:
    stages = whole("a")
    predicted = predict(MODEL, stages).tokens_per_s[1]
    factors = corrected({}, stages, predicted, measured=predicted / 2)  # twice as slow
    assert predict(MODEL, stages, factors=factors).tokens_per_s[1] == pytest.approx(predicted / 2)
    # a device never measured is predicted with the same ratio
    other = predict(MODEL, whole("b"), factors=factors).tokens_per_s[1]
    assert other == pytest.approx(predicted / 2)
    # measured again, faster: its own factor moves, the default stays
    again = corrected(factors, stages, predicted / 2, measured=predicted)
    assert again["a"] == pytest.approx(1.0) and again["*"] == factors["*"]


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        predict(MODEL, [])
    with pytest.raises(ValueError, match="positive"):
        corrected({}, whole(), 10.0, 0.0)
