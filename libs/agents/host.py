"""The real host as a device: probed with psutil (and NVML where a GPU is present)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import psutil

from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    TELEMETRY,
    AnnounceRequest,
    DeviceAnnounce,
    DeviceClass,
    GpuSample,
    TelemetrySample,
)
from libs.devices.calibration import Calibration
from libs.devices.host import GB, host_capabilities, host_device_id, temperature_c
from libs.runtime.bus import Bus, Delivery

log = logging.getLogger(__name__)


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def gpu_sample(nvml: Any | None) -> GpuSample | None:
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuSample(
            utilisation=nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            memory_used_gb=memory.used / GB,
            memory_total_gb=memory.total / GB,
            power_w=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            temperature_c=float(nvml.nvmlDeviceGetTemperature(handle, 0)),
        )
    except Exception as exc:
        log.debug("nvml sample failed", extra={"error": repr(exc)})
        return None


class HostAgent:
    def __init__(self, bus: Bus, calibration: Calibration, interval_s: float) -> None:
        self.bus, self.interval_s = bus, interval_s
        self.nvml = _nvml()
        self.device_id = host_device_id()
        battery = psutil.sensors_battery()
        self.capabilities = host_capabilities(calibration, gpus=1 if self.nvml else 0)
        self.device_class = DeviceClass.LAPTOP if battery else DeviceClass.WORKSTATION
        self.seq = 0

    async def rtt_ms(self) -> float:
        started = time.perf_counter()
        await self.bus.flush(timeout_s=5)
        return (time.perf_counter() - started) * 1000.0

    async def sample(self) -> TelemetrySample:
        memory = psutil.virtual_memory()
        battery = psutil.sensors_battery()
        utilisation = psutil.cpu_percent(interval=None) / 100.0
        self.seq += 1
        return TelemetrySample(
            device_id=self.device_id,
            seq=self.seq,
            ts=time.time(),
            cpu_utilisation=min(1.0, utilisation),
            memory_total_gb=memory.total / GB,
            memory_available_gb=memory.available / GB,
            power_w=self.capabilities.typical_power_w * (0.25 + 0.75 * utilisation),
            temperature_c=temperature_c() or 40.0,  # none exposed (as in VMs)
            battery_percent=battery.percent if battery else None,
            plugged=battery.power_plugged if battery else None,
            network_rtt_ms=await self.rtt_ms(),
            network_bandwidth_mbps=self.capabilities.network_bandwidth_mbps,
            gpu=gpu_sample(self.nvml),
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
        psutil.cpu_percent(interval=None)  # prime the utilisation counter
        while not stop.is_set():
            sample = await self.sample()
            await self.bus.publish(TELEMETRY, sample, device_id=self.device_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
