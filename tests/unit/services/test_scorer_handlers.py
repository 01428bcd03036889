"""The scorer's handlers on the in-memory bus and an in-memory Redis (``fakeredis``): what it
writes and publishes for each message, without a server (tests/integration runs it on real
ones)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest

from libs.contracts import (
    ANNOUNCE,
    DEVICE_FAILED,
    DEVICE_LEAVING,
    DEVICE_RECOVERED,
    MODE_CHANGE,
    SCORE,
    TELEMETRY,
    DeviceAnnounce,
    DeviceClass,
    DeviceFailed,
    DeviceLeaving,
    DeviceState,
    Mode,
    ModeChange,
    ScoreUpdate,
)
from libs.contracts.keys import DeviceRow, Keys
from libs.contracts.profiles import DimensionWeights
from libs.core.profiles import BUILTIN_PROFILES
from libs.runtime.lifecycle import Background
from libs.runtime.memory_bus import MemoryBus
from services.scorer.metrics import ScorerMetrics
from services.scorer.service import DEADLINE_MARGIN_S, Scorer
from services.scorer.settings import ScorerSettings
from tests.builders import NOW, make_capabilities, make_telemetry


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def scorer() -> AsyncIterator[tuple[Scorer, MemoryBus, Any, Clock]]:
    bus, redis, clock = MemoryBus(), fakeredis.FakeAsyncRedis(decode_responses=True), Clock()
    # Periodic steps far apart: each test flushes and detects by hand.
    settings = ScorerSettings(flush_interval_ms=5000, detector_interval_s=10, key_prefix="u")
    scorer = Scorer(settings, bus, redis, ScorerMetrics.create(), clock)
    await scorer.start()
    yield scorer, bus, redis, clock
    await scorer.background.close()
    await bus.close()


async def announce(bus: MemoryBus, device_id: str, device_class: DeviceClass, **caps: Any) -> None:
    message = DeviceAnnounce(
        device_id=device_id,
        device_class=device_class,
        capabilities=make_capabilities(**caps),
        emulated=True,
        interval_s=1.0,
        ts=NOW,
    )
    await bus.publish(ANNOUNCE, message, device_id=device_id)


async def row(redis: Any, device_id: str) -> DeviceRow:
    return DeviceRow.decode(device_id, await redis.hgetall(Keys("u").device(device_id)))


async def test_a_sample_is_scored_written_as_a_typed_row_and_published(scorer: Any) -> None:
    service, bus, redis, _ = scorer
    await announce(bus, "phone-1", DeviceClass.PHONE)
    await bus.publish(TELEMETRY, make_telemetry("phone-1"), device_id="phone-1")
    await bus.settle()
    await service.flush()
    await bus.settle()
    stored = await row(redis, "phone-1")
    assert stored.scored and stored.device_class == DeviceClass.PHONE
    assert stored.sample == make_telemetry("phone-1")
    [update] = bus.sent(SCORE)
    assert isinstance(update, ScoreUpdate) and update.total == stored.total
    assert await redis.zscore(Keys("u").rank("total"), "phone-1") == pytest.approx(stored.total)


async def test_a_sample_breaking_its_contract_is_counted_not_stored(scorer: Any) -> None:
    service, bus, redis, _ = scorer
    await announce(bus, "phone-1", DeviceClass.PHONE)
    data = json.loads(TELEMETRY.encode(make_telemetry("phone-1")))
    data["cpu_utilisation"] = 7.0  # 700 % busy
    bus.send_raw(TELEMETRY.subject(device_id="phone-1"), json.dumps(data).encode())
    await bus.settle()
    await service.flush()
    assert await redis.hgetall(Keys("u").device("phone-1")) == {}
    assert (await redis.hgetall(Keys("u").stats))["rejected:out_of_range"] == "1"
    counted = service.metrics.rejected.labels(TELEMETRY.name, "out_of_range")._value.get()
    assert counted == 1


async def test_the_detector_is_due_at_the_earliest_deadline_not_a_period_later(
    scorer: Any,
) -> None:
    """The fixture's detector runs every 10 s; a device heard from now is due 3 intervals and
    the grace (1 s intervals: 3.25 s) later, and the detector wakes then."""
    service, bus, _, clock = scorer
    await announce(bus, "laptop-1", DeviceClass.LAPTOP)
    await bus.publish(TELEMETRY, make_telemetry("laptop-1"), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    await service.detect()
    assert service.due_in_s() == pytest.approx(3.25 + DEADLINE_MARGIN_S)
    clock.now += service.due_in_s()
    await service.detect()
    await bus.settle()
    [failed] = bus.sent(DEVICE_FAILED)
    assert isinstance(failed, DeviceFailed) and failed.device_id == "laptop-1"
    assert service.due_in_s() > 10  # no live device left: the period paces it again


async def test_a_periodic_step_runs_when_it_is_due_before_its_period() -> None:
    runs: list[float] = []

    async def step() -> None:
        runs.append(asyncio.get_running_loop().time())

    background = Background("test")
    background.every(60.0, step, lambda: 0.01)
    await asyncio.sleep(0.5)
    await background.close()
    assert len(runs) >= 2  # a 60 s period alone would not have run it once


async def test_a_silent_device_is_declared_failed_after_three_missed_samples(scorer: Any) -> None:
    service, bus, redis, clock = scorer
    await announce(bus, "laptop-1", DeviceClass.LAPTOP)
    await bus.publish(TELEMETRY, make_telemetry("laptop-1"), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    clock.now += 2.5  # 2.5 intervals of silence: not yet
    await service.detect()
    assert bus.sent(DEVICE_FAILED) == []
    sample = make_telemetry("laptop-1", seq=2, ts=clock.now)  # a sample is the heartbeat
    await bus.publish(TELEMETRY, sample, device_id="laptop-1")
    await bus.settle()
    await service.flush()
    clock.now += 3.5
    await service.detect()
    await bus.settle()
    [failed] = bus.sent(DEVICE_FAILED)
    assert isinstance(failed, DeviceFailed) and failed.device_id == "laptop-1"
    assert (await row(redis, "laptop-1")).state == DeviceState.FAILED
    assert await redis.smembers(Keys("u").failed) == {"laptop-1"}


async def test_a_leaving_device_fails_at_once_and_its_last_reports_do_not_revive_it(
    scorer: Any,
) -> None:
    service, bus, redis, clock = scorer
    await announce(bus, "laptop-1", DeviceClass.LAPTOP)
    await bus.publish(TELEMETRY, make_telemetry("laptop-1"), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    leaving = DeviceLeaving(device_id="laptop-1", ts=clock.now, reason="Ctrl-C")
    await bus.publish(DEVICE_LEAVING, leaving, device_id="laptop-1")
    await bus.settle()
    await service.detect()  # no silence needed
    await bus.settle()
    [failed] = bus.sent(DEVICE_FAILED)
    assert failed.device_id == "laptop-1"
    # What it still sends while its shards move does not bring it back.
    clock.now += 0.5
    await bus.publish(TELEMETRY, make_telemetry("laptop-1", seq=3), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    await bus.settle()
    assert bus.sent(DEVICE_RECOVERED) == []
    assert (await row(redis, "laptop-1")).state == DeviceState.FAILED
    # Joining again (it announces) makes it a device like any other.
    await announce(bus, "laptop-1", DeviceClass.LAPTOP)
    await bus.publish(TELEMETRY, make_telemetry("laptop-1", seq=4), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    await bus.settle()
    assert [r.device_id for r in bus.sent(DEVICE_RECOVERED)] == ["laptop-1"]


async def test_a_device_only_redis_knows_that_is_said_to_leave_fails_at_once(
    scorer: Any,
) -> None:
    """A scorer started again knows a device only from Redis until it reports; one revoked
    while the cluster was down never reports: said to leave, it fails at the next pass."""
    service, bus, redis, clock = scorer
    await announce(bus, "laptop-1", DeviceClass.LAPTOP)
    await bus.publish(TELEMETRY, make_telemetry("laptop-1"), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    await service.background.close()  # it stops; another starts on the same Redis
    settings = ScorerSettings(flush_interval_ms=5000, detector_interval_s=10, key_prefix="u")
    again = Scorer(settings, bus, redis, ScorerMetrics.create(), clock)  # a restart
    await again.start()
    try:
        clock.now += 1.0
        leaving = DeviceLeaving(device_id="laptop-1", ts=clock.now, reason="revoked")
        await bus.publish(DEVICE_LEAVING, leaving, device_id="laptop-1")
        nobody = leaving.model_copy(update={"device_id": "nobody"})
        await bus.publish(DEVICE_LEAVING, nobody, device_id="nobody")
        await bus.settle()
        await again.detect()
        await bus.settle()
        assert [f.device_id for f in bus.sent(DEVICE_FAILED)] == ["laptop-1"]
        assert (await row(redis, "laptop-1")).state == DeviceState.FAILED
        assert "nobody" not in again.table  # never known: nothing to fail
    finally:
        await again.background.close()


async def test_a_silence_the_scorer_could_not_hear_fails_nobody(scorer: Any) -> None:
    """NATS out of reach (restarting): every device is silent to the scorer, which fails none
    of them then, and gives each its full window once it hears NATS again; one that stays
    silent after that fails as usual."""
    service, bus, _, clock = scorer
    heard = [True]
    service.connected = lambda: heard[0]
    for device_id in ("laptop-1", "phone-1"):
        await announce(bus, device_id, DeviceClass.LAPTOP)
        await bus.publish(TELEMETRY, make_telemetry(device_id), device_id=device_id)
    await bus.settle()
    await service.flush()
    heard[0] = False
    clock.now += 10.0  # far past 3 missed 1 s heartbeats
    await service.detect()
    heard[0] = True
    clock.now += 1.0
    await service.detect()  # heard again: a new window, nobody failed
    await bus.settle()
    assert bus.sent(DEVICE_FAILED) == []
    clock.now += 2.0
    await bus.publish(TELEMETRY, make_telemetry("laptop-1", seq=2), device_id="laptop-1")
    await bus.settle()
    await service.flush()
    clock.now += 2.0  # laptop-1 reported again, phone-1 stays silent past its window
    await service.detect()
    await bus.settle()
    assert [f.device_id for f in bus.sent(DEVICE_FAILED)] == ["phone-1"]


async def test_a_custom_profile_reweights_every_total(scorer: Any) -> None:
    service, bus, redis, clock = scorer
    for device_id, device_class in (
        ("phone-1", DeviceClass.PHONE),
        ("ws-1", DeviceClass.WORKSTATION),
    ):
        await announce(bus, device_id, device_class)
        await bus.publish(TELEMETRY, make_telemetry(device_id), device_id=device_id)
    await bus.settle()
    await service.flush()
    compute_only = DimensionWeights(
        compute=1.0, memory=0.0, efficiency=0.0, network=0.0, stability=0.0
    )
    change = ModeChange(
        mode=Mode.BALANCED,
        previous=Mode.BALANCED,
        manual=True,
        reason="profile",
        ts=clock.now,
        weights=compute_only,
    )
    await bus.publish(MODE_CHANGE, change)
    await bus.settle()
    clock.now += 0.1
    await service.flush()
    for device_id in ("phone-1", "ws-1"):
        stored = await row(redis, device_id)
        assert stored.total == pytest.approx(stored.compute)  # the total is compute alone now
    back = change.model_copy(update={"weights": None})
    await bus.publish(MODE_CHANGE, back)
    await bus.settle()
    await service.flush()
    stored = await row(redis, "phone-1")
    weights = BUILTIN_PROFILES[Mode.BALANCED].dimensions.as_tuple()
    assert stored.total == pytest.approx(
        sum(w * d for w, d in zip(weights, stored.dimensions, strict=True))
    )


async def test_a_device_without_power_or_temperature_readings_is_scored_and_kept_unknown(
    scorer: Any,
) -> None:
    service, bus, redis, _ = scorer
    await announce(bus, "host-a", DeviceClass.WORKSTATION)
    blind = make_telemetry("host-a", power_w=None, temperature_c=None)
    await bus.publish(TELEMETRY, blind, device_id="host-a")
    await bus.settle()
    await service.flush()
    stored = await row(redis, "host-a")
    assert stored.scored
    assert stored.sample is not None
    assert stored.sample.power_w is None and stored.sample.temperature_c is None
