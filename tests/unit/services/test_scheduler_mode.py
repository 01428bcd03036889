"""The scheduler's automatic mode on a burst of requests and then a minute of idle: the mode
stays (it once switched the idle cluster to performance mode, "throughput dropped 94 %"),
while a real fall in tokens/s per busy slot still switches. Real Redis holds the
devices' rows as the scorer writes them; the clock is the test's (no sleeping)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from libs.contracts import MODE_CHANGE, DeviceAnnounce, DeviceClass, Mode
from libs.contracts.keys import DeviceField, Keys, scored_fields
from libs.runtime.memory_bus import MemoryBus
from services.scheduler.checkpoints import CheckpointStore
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.builders import NOW, make_capabilities, make_telemetry

DEVICES = ("ws-a", "ws-b")
#: How often the workers report (and the switcher is fed, here).
EVERY_S = 5.0


class Cluster:
    """A scheduler over two scored workstations whose telemetry the test writes."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis, self.keys, self.now = redis, Keys(prefix), NOW
        self.bus = MemoryBus()
        settings = SchedulerSettings(key_prefix=prefix, cycle_ms=100, mode_eval_s=3600)
        checkpoints = CheckpointStore(redis, None, self.keys, settings.checkpoints_kept)
        self.service = Scheduler(
            settings, self.bus, redis, checkpoints, SchedulerMetrics.create(), lambda: self.now
        )

    async def report(self, tokens_per_s: float | None, in_flight: int) -> None:
        """Each device's sample: its measured tokens/s (None: none in its window) and the
        requests it is serving; then one mode evaluation, ``EVERY_S`` later."""
        self.now += EVERY_S
        for device_id in DEVICES:
            sample = make_telemetry(
                device_id,
                ts=self.now,
                power_w=100.0 if in_flight else 60.0,
                measured_tokens_per_s=tokens_per_s,
                queue_depth=in_flight,
            )
            scores = dict.fromkeys(("compute", "memory", "efficiency", "network", "stability"), 0.5)
            row = scored_fields(
                scores | {"total": 0.5}, DeviceClass.WORKSTATION, self.now, Mode.BALANCED, 1.0
            )
            fields: dict[Any, Any] = {**row, DeviceField.SAMPLE: sample.model_dump_json()}
            await self.redis.hset(self.keys.device(device_id), mapping=fields)
            await self.redis.zadd(self.keys.rank("total"), {device_id: 0.5})
        await self.service.modes.evaluate()

    async def start(self) -> None:
        for device_id in DEVICES:
            announce = DeviceAnnounce(
                device_id=device_id,
                device_class=DeviceClass.WORKSTATION,
                capabilities=make_capabilities(),
                emulated=True,
                interval_s=EVERY_S,
                ts=NOW,
            )
            await self.redis.set(self.keys.caps(device_id), announce.model_dump_json())
        await self.report(None, 0)
        await self.service.start()

    def changes(self) -> list[Any]:
        return list(self.bus.sent(MODE_CHANGE))


@pytest.fixture
async def cluster(redis: Redis, uid: str) -> AsyncIterator[Cluster]:
    cluster = Cluster(redis, uid)
    await cluster.start()
    yield cluster
    await cluster.service.abandon()
    await cluster.bus.close()


async def burst(cluster: Cluster, tokens_per_s: float, seconds: float) -> None:
    """Eight requests at a time on each device for ``seconds``."""
    for _ in range(int(seconds / EVERY_S)):
        await cluster.report(tokens_per_s, 8)


async def test_a_burst_then_a_minute_of_idle_keeps_the_mode(cluster: Cluster) -> None:
    await burst(cluster, 160.0, 60.0)
    # The burst ends: the workers' 10 s rate windows empty out, nothing is in flight.
    await cluster.report(90.0, 0)
    await cluster.report(10.0, 0)
    for _ in range(int(60.0 / EVERY_S)):
        await cluster.report(None, 0)
    assert cluster.service.modes.mode == Mode.BALANCED
    assert cluster.changes() == []


async def test_a_fall_in_tokens_per_busy_slot_at_the_same_load_still_switches(
    cluster: Cluster,
) -> None:
    await burst(cluster, 160.0, 60.0)
    await burst(cluster, 140.0, 10.0)  # the same requests, 12.5 % slower
    assert cluster.service.modes.mode == Mode.PERFORMANCE
    [change] = cluster.changes()
    assert change.mode == Mode.PERFORMANCE and not change.manual
    assert "per busy slot dropped 12%" in change.reason
