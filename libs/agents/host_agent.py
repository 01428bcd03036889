"""The real host as a device (``TESSERA_TELEMETRY_MODE=host``): a ``HostDevice`` announced and
sampled as a worker's host is (psutil, NVML where a GPU is present; unknown readings sent as
none), with the round trip to NATS measured at each sample and the bandwidth to it at start and
every ``BANDWIDTH_EVERY_S`` (``link_probe.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from libs.agents.link_probe import BANDWIDTH_EVERY_S, measure_bandwidth, round_trip_ms
from libs.contracts import ANNOUNCE, ANNOUNCE_REQUEST, TELEMETRY, AnnounceRequest, TelemetrySample
from libs.devices.calibration import Calibration
from libs.devices.host_device import HostDevice, host_device_id
from libs.runtime.bus import Bus, Delivery

log = logging.getLogger(__name__)


class HostAgent:
    def __init__(self, bus: Bus, calibration: Calibration, interval_s: float) -> None:
        self.bus, self.interval_s = bus, interval_s
        self.device = HostDevice.probe(host_device_id(), calibration)
        self.device_id = self.device.device_id
        self.rng = np.random.default_rng()  # the host's readings draw nothing from it
        self.seq = 0

    async def sample(self) -> TelemetrySample:
        self.device.base_rtt_ms = await round_trip_ms(self.bus)  # measured, not the default
        self.seq += 1
        return self.device.sample(self.seq, time.time(), self.rng)

    async def run(self, stop: asyncio.Event) -> None:
        async def again(
            request: AnnounceRequest | None = None, msg: Delivery | None = None
        ) -> None:
            # Dated now: a restarted scheduler waits for announces made since it started.
            announce = self.device.announce(time.time(), self.interval_s)
            await self.bus.publish(ANNOUNCE, announce, device_id=self.device_id)

        await self.bus.subscribe(ANNOUNCE_REQUEST, again)
        await measure_bandwidth(self.bus, self.device)
        await again()
        measured_at = time.monotonic()
        while not stop.is_set():
            if time.monotonic() - measured_at >= BANDWIDTH_EVERY_S:
                await measure_bandwidth(self.bus, self.device)
                await again()
                measured_at = time.monotonic()
            sample = await self.sample()
            await self.bus.publish(TELEMETRY, sample, device_id=self.device_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
