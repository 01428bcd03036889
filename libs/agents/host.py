"""The real host as a device (``TESSERA_TELEMETRY_MODE=host``): announced and sampled from
``HostProbe`` (psutil, NVML where a GPU is present; unknown readings sent as none)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import psutil

from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    TELEMETRY,
    AnnounceRequest,
    DeviceAnnounce,
    DeviceClass,
    TelemetrySample,
)
from libs.devices.calibration import Calibration
from libs.devices.host import HostProbe, host_capabilities, host_device_id
from libs.runtime.bus import Bus, Delivery

log = logging.getLogger(__name__)


class HostAgent:
    def __init__(self, bus: Bus, calibration: Calibration, interval_s: float) -> None:
        self.bus, self.interval_s = bus, interval_s
        self.host = HostProbe()
        self.device_id = host_device_id()
        battery = psutil.sensors_battery()
        self.capabilities = host_capabilities(calibration, self.host.gpus)
        self.device_class = DeviceClass.LAPTOP if battery else DeviceClass.WORKSTATION
        self.seq = 0

    async def rtt_ms(self) -> float:
        started = time.perf_counter()
        await self.bus.flush(timeout_s=5)
        return (time.perf_counter() - started) * 1000.0

    async def sample(self) -> TelemetrySample:
        read = self.host.read()
        self.seq += 1
        return TelemetrySample(
            device_id=self.device_id,
            seq=self.seq,
            ts=time.time(),
            cpu_utilisation=read.cpu_utilisation,
            memory_total_gb=self.capabilities.memory_total_gb,
            memory_available_gb=min(read.memory_available_gb, self.capabilities.memory_total_gb),
            power_w=read.power_w,  # None where the host measures none: unknown, not guessed
            temperature_c=read.temperature_c,
            battery_percent=read.battery_percent,
            plugged=read.plugged,
            network_rtt_ms=await self.rtt_ms(),
            network_bandwidth_mbps=self.capabilities.network_bandwidth_mbps,
            gpu=read.gpu,
        )

    async def run(self, stop: asyncio.Event) -> None:
        announce = DeviceAnnounce(
            device_id=self.device_id,
            device_class=self.device_class,
            capabilities=self.capabilities,
            emulated=False,
            interval_s=self.interval_s,
            ts=time.time(),
        )

        async def again(request: AnnounceRequest, msg: Delivery) -> None:
            await self.bus.publish(ANNOUNCE, announce, device_id=self.device_id)

        await self.bus.subscribe(ANNOUNCE_REQUEST, again)
        await self.bus.publish(ANNOUNCE, announce, device_id=self.device_id)
        while not stop.is_set():
            sample = await self.sample()
            await self.bus.publish(TELEMETRY, sample, device_id=self.device_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
