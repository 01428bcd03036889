"""The real host as a device: probed with psutil (and NVML where a GPU is present)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

import psutil

from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    TELEMETRY,
    AnnounceRequest,
    Capabilities,
    DeviceAnnounce,
    DeviceClass,
    GpuSample,
    MemoryType,
    TelemetrySample,
)
from libs.devices.calibration import Calibration
from libs.runtime.bus import Bus, Delivery

log = logging.getLogger(__name__)
GB = 1e9
WATTS_PER_CORE = 10.0  # typical-power estimate when nothing measures it


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


def temperature_c() -> float:
    """The hottest sensor psutil exposes; 40 °C when the host exposes none (as in VMs)."""
    readings: dict[str, list[Any]] = getattr(psutil, "sensors_temperatures", lambda: {})()
    values = [t.current for entries in readings.values() for t in entries if t.current]
    return float(max(values)) if values else 40.0


class HostAgent:
    def __init__(self, bus: Bus, calibration: Calibration, interval_s: float) -> None:
        self.bus, self.interval_s = bus, interval_s
        self.nvml = _nvml()
        self.device_id = (
            "host-" + "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40]
        )
        battery = psutil.sensors_battery()
        cores = psutil.cpu_count() or 1
        typical = WATTS_PER_CORE * cores
        self.capabilities = Capabilities(
            fp32_tflops=calibration.fp32_gflops / 1000.0,
            int8_tops=calibration.int8_gops / 1000.0,
            memory_bandwidth_gbps=calibration.memory_bandwidth_gbps,
            memory_total_gb=psutil.virtual_memory().total / GB,
            memory_type=MemoryType.DDR4,
            typical_power_w=typical,
            max_power_w=typical * 1.5,
            thermal_limit_c=85.0 if battery else 95.0,
            delta_t_c=25.0,
            has_battery=battery is not None,
            gpu_count=1 if self.nvml else 0,
            network_bandwidth_mbps=1000.0,
        )
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
            temperature_c=temperature_c(),
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
