"""Many emulated devices in one process.

Each interval every device steps its models and publishes one sample, spread evenly over the
interval. The devices react to the work sent to them and to DVFS hints: the fleet listens on
the hint subjects (one wildcard subscription, dispatched to the device named in the subject)
and adjusts clock speed.

A device's work has one owner. A device a worker stands in for (``follow_work=False``, the
worker's own agent) is assigned work by its worker alone, once a shard really loaded, so its
power and load follow only what is loaded. An emulated fleet without workers
(``follow_work=True``: the simulator, scheduling demos) owns its devices' work itself: it
follows the shard tasks sent to them (nothing loads there; the scheduler expects no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from prometheus_client import Counter

from libs.agents.link_probe import BANDWIDTH_EVERY_S, measure_bandwidth, round_trip_ms
from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    DVFS_HINT,
    SHARD_TASK,
    TELEMETRY,
    AnnounceRequest,
    Channel,
    DvfsHint,
    ShardTask,
)
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus, Delivery

log = logging.getLogger(__name__)

SLICES_PER_INTERVAL = 10
#: Up to this many devices, an agent subscribes to each one's subjects (else to wildcards).
OWN_SUBJECTS = 16


def work_key(task: ShardTask) -> str:
    """The device's name for the work a shard task loads."""
    return f"{task.deployment_id}:{task.shard_index}"


def shard_intensity(task: ShardTask) -> float:
    """Compute share a shard keeps busy: a fixed base plus its share of the layers."""
    return min(1.0, 0.1 + 0.5 / task.shard_count)


class FleetAgent:
    def __init__(
        self,
        bus: Bus,
        devices: Sequence[EmulatedDevice],
        interval_s: float,
        *,
        seed: int = 0,
        announce_every_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        published: Counter | None = None,
        follow_work: bool = True,
        measure_rtt: bool = False,
    ) -> None:
        """``follow_work``: whether this agent owns its devices' work (no worker runs them);
        ``measure_rtt``: each sample's round trip is this agent's own to NATS, measured (a
        worker on a link of its own), not its device's emulated one."""
        self.bus = bus
        self.measure_rtt = measure_rtt
        #: When each device's bandwidth was last measured (``measure_rtt`` only).
        self.bandwidth_at: dict[str, float] = {}
        self.follow_work = follow_work
        self.published = published
        self.devices = {d.device_id: d for d in devices}
        self.interval_s = interval_s
        self.announce_every_s = announce_every_s
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.seq = 0

    async def announce(self) -> None:
        now = self.clock()
        for device in self.devices.values():
            if device.reporting(now):
                message = device.announce(now, self.interval_s)
                await self.bus.publish(ANNOUNCE, message, device_id=device.device_id)

    async def on_work(self, task: ShardTask, msg: Delivery) -> None:
        """A shard task for a device no worker runs: its work follows the task."""
        device = self.devices.get(task.device_id)
        if device is None:
            return
        key = work_key(task)
        if task.action == "load":
            device.assign(key, shard_intensity(task))
        else:
            device.unassign(key)

    async def on_announce_request(self, request: AnnounceRequest, msg: Delivery) -> None:
        await self.announce()

    async def on_hint(self, hint: DvfsHint, msg: Delivery) -> None:
        if (device := self.devices.get(hint.device_id)) is not None:
            device.frequency_scale = hint.frequency_scale
            if hint.sleep_after_s is not None:
                device.sleep_after_s = hint.sleep_after_s

    async def tick(self, devices: Sequence[EmulatedDevice], dt: float) -> None:
        now = self.clock()
        self.seq += 1
        for device in devices:
            device.step(dt, now)
            if not device.reporting(now):
                continue
            if self.measure_rtt:
                device.base_rtt_ms = await round_trip_ms(self.bus)
                await self.measure_bandwidth(device, now)
            sample = device.sample(self.seq, now, self.rng)
            await self.bus.publish(TELEMETRY, sample, device_id=device.device_id)
            if self.published is not None:
                self.published.inc()

    async def measure_bandwidth(
        self, device: EmulatedDevice, now: float, announce: bool = True
    ) -> None:
        """Every ``BANDWIDTH_EVERY_S``, ``device``'s bandwidth to NATS measured (this agent's
        own: a worker on a link of its own) and, with ``announce``, announced. A measurement
        that fails keeps the figure it had."""
        if now - self.bandwidth_at.get(device.device_id, -BANDWIDTH_EVERY_S) < BANDWIDTH_EVERY_S:
            return
        self.bandwidth_at[device.device_id] = now
        if await measure_bandwidth(self.bus, device) and announce:
            message = device.announce(now, self.interval_s)
            await self.bus.publish(ANNOUNCE, message, device_id=device.device_id)

    def _mine(self, channel: Channel[Any]) -> list[str]:
        """The subjects of this agent's own devices (one each for a few; a wildcard for a
        fleet): an agent's NATS user may read only its own devices' work and hints."""
        if len(self.devices) > OWN_SUBJECTS:
            return [channel.wildcard]
        return [channel.pattern(device_id=d) for d in self.devices]

    async def run(self, stop: asyncio.Event) -> None:
        work = self._mine(SHARD_TASK) if self.follow_work else []
        subs = [
            *[await self.bus.subscribe(SHARD_TASK, self.on_work, subject=s) for s in work],
            *[
                await self.bus.subscribe(DVFS_HINT, self.on_hint, subject=s)
                for s in self._mine(DVFS_HINT)
            ],
            await self.bus.subscribe(ANNOUNCE_REQUEST, self.on_announce_request),
        ]
        if self.measure_rtt:  # its link's bandwidth before it is first announced
            for device in self.devices.values():
                await self.measure_bandwidth(device, self.clock(), announce=False)
        await self.announce()
        devices = list(self.devices.values())
        slices = [devices[i::SLICES_PER_INTERVAL] for i in range(SLICES_PER_INTERVAL)]
        last_announce = self.clock()
        try:
            while not stop.is_set():
                for part in slices:
                    await self.tick(part, self.interval_s)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval_s / len(slices))
                    if stop.is_set():
                        break
                if self.clock() - last_announce >= self.announce_every_s:
                    await self.announce()
                    last_announce = self.clock()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
