"""This host as a worker's device (``tessera join``): nothing emulated.

Its memory, battery, temperature and load are read from the host (psutil), its GPU through
NVML, its speed is what ``tessera calibrate`` measured here, and its power is read where the
host exposes it (RAPL energy counters, or a discharging battery). A reading the host does not
expose (power without RAPL or battery, temperature without sensors, as in VMs) is sent as none:
the scorer, the dashboard and ``tessera devices`` show it unknown. ``HostProbe`` is shared with
the telemetry agent's ``HostAgent``. The typical power in its capabilities remains an estimate
(10 W per core) where nothing measures one, as a datasheet figure would be.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path
from typing import Any, get_args

import numpy as np
import psutil

from libs.contracts import (
    Capabilities,
    DeviceAnnounce,
    DeviceClass,
    GpuSample,
    MemoryType,
)
from libs.contracts.device import Reading
from libs.devices.calibration import Calibration
from libs.devices.emulated import EmulatedDevice, Readings

log = logging.getLogger(__name__)
GB = 1e9
WATTS_PER_CORE = 10.0  #: the typical-power estimate where nothing measures it
RAPL = Path("/sys/class/powercap")
POWER_SUPPLY = Path("/sys/class/power_supply")


def host_device_id(hostname: str | None = None) -> str:
    """``host-<hostname>``: how this host names itself as a device unless told."""
    name = hostname or socket.gethostname()
    return "host-" + "".join(c if c.isalnum() else "_" for c in name)[:40]


def host_capabilities(calibration: Calibration, gpus: int = 0) -> Capabilities:
    battery = psutil.sensors_battery()
    typical = WATTS_PER_CORE * (psutil.cpu_count() or 1)
    return Capabilities(
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
        gpu_count=gpus,
        network_bandwidth_mbps=1000.0,
    )


def temperature_c() -> float | None:
    """The hottest sensor psutil exposes; None where the host exposes none (as in VMs)."""
    readings: dict[str, list[Any]] = getattr(psutil, "sensors_temperatures", lambda: {})()
    values = [t.current for entries in readings.values() for t in entries if t.current]
    return float(max(values)) if values else None


class PowerMeter:
    """Watts from the host's RAPL package counters, else None (not measured here)."""

    def __init__(self, root: Path = RAPL) -> None:
        self.files = sorted(root.glob("intel-rapl:[0-9]*/energy_uj")) if root.is_dir() else []
        self.last: tuple[float, int] | None = None

    @property
    def measures(self) -> bool:
        return bool(self.files)

    def watts(self) -> float | None:
        try:
            total = sum(int(f.read_text()) for f in self.files)
        except (OSError, ValueError):
            return None
        now, last = time.monotonic(), self.last
        self.last = (now, total)
        if last is None or not self.files or total < last[1] or now <= last[0]:
            return None  # the first reading, or the counter wrapped
        return (total - last[1]) / 1e6 / (now - last[0])


def discharge_w(root: Path = POWER_SUPPLY) -> float | None:
    """What a discharging battery delivers (power_now, else current_now × voltage_now); None
    while it charges or is full, or where the host has none."""
    for supply in sorted(root.glob("BAT*")) if root.is_dir() else []:
        try:
            if (supply / "status").read_text().strip() != "Discharging":
                continue
            if (supply / "power_now").exists():
                return int((supply / "power_now").read_text()) / 1e6
            current = int((supply / "current_now").read_text())
            return current * int((supply / "voltage_now").read_text()) / 1e12
        except (OSError, ValueError):
            continue
    return None


def open_nvml() -> Any | None:
    """NVML (``pynvml``) initialised, else None (no NVIDIA driver or no pynvml)."""
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


class HostProbe:
    """What this host measures of itself: load, memory, sensors, battery, power (RAPL, else a
    discharging battery), the first GPU through NVML. Nothing is estimated here."""

    def __init__(self, rapl: Path = RAPL, supplies: Path = POWER_SUPPLY) -> None:
        self.meter = PowerMeter(rapl)
        self.supplies = supplies
        self.nvml = open_nvml()
        psutil.cpu_percent(interval=None)  # primes the load counter

    @property
    def gpus(self) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetCount()) if self.nvml is not None else 0
        except Exception:
            return 0

    def power_source(self) -> str:
        """Where the power readings come from, for the log."""
        if self.meter.measures:
            return "RAPL"
        if any(self.supplies.glob("BAT*")) if self.supplies.is_dir() else False:
            return "the battery while it discharges, else unknown"
        return "unknown (no RAPL, no battery): reported as none"

    def read(self) -> Readings:
        """The host's readings now (its network is left to the device: see ``Readings``)."""
        battery = psutil.sensors_battery()
        watts = self.meter.watts() if self.meter.measures else discharge_w(self.supplies)
        return Readings(
            cpu_utilisation=min(1.0, psutil.cpu_percent(interval=None) / 100.0),
            memory_available_gb=psutil.virtual_memory().available / GB,
            power_w=watts,
            temperature_c=temperature_c(),
            battery_percent=battery.percent if battery else None,
            plugged=bool(battery.power_plugged) if battery else None,
            gpu=gpu_sample(self.nvml),
        )


@dataclasses.dataclass
class HostDevice(EmulatedDevice):
    """The host itself; ``step`` emulates nothing and ``sample`` reads the host."""

    host: HostProbe = dataclasses.field(default_factory=HostProbe)
    #: What the user lets the cluster use here (``tessera join --memory-gb``); None: all.
    memory_cap_gb: float | None = None

    @property
    def memory_limit_gb(self) -> float:
        total = self.capabilities.memory_total_gb
        return total if self.memory_cap_gb is None else min(total, self.memory_cap_gb)

    @classmethod
    def probe(
        cls, device_id: str, calibration: Calibration, memory_gb: float | None = None
    ) -> HostDevice:
        host = HostProbe()
        caps = host_capabilities(calibration, host.gpus)
        battery = psutil.sensors_battery()
        device = cls(
            device_id,
            DeviceClass.LAPTOP if battery else DeviceClass.WORKSTATION,
            caps,
            base_rtt_ms=1.0,
            battery_wh=0.0,
            speed_factor=1.0,
            thermal_tau_s=60.0,
            battery_percent=battery.percent if battery else None,
            plugged=bool(battery.power_plugged) if battery else True,
            started_at=time.time(),
            host=host,
            memory_cap_gb=memory_gb,
            sources=dict.fromkeys(get_args(Reading), "measured"),
        )
        if not host.meter.measures:  # its power figures are WATTS_PER_CORE's estimate
            device.sources["power"] = "estimated"
        log.info(
            "this host is the device",
            extra={
                "device_id": device_id,
                "host": socket.gethostname(),
                "memory_gb": round(caps.memory_total_gb, 2),
                "cluster_may_use_gb": round(device.memory_limit_gb, 2),
                "gpus": host.gpus,
                "power": host.power_source(),
                "temperature": "sensors" if temperature_c() is not None else "unknown",
            },
        )
        return device

    def step(self, dt: float, now: float) -> None:
        """Nothing to emulate: the readings are the host's."""

    def announce(self, now: float, interval_s: float) -> DeviceAnnounce:
        return super().announce(now, interval_s).model_copy(update={"emulated": False})

    def read(self, now: float, rng: np.random.Generator) -> Readings:
        """The host's own readings; the memory offered is what the cap and the shards leave."""
        read = self.host.read()
        offered = self.memory_limit_gb - self.reserved_memory_gb
        return dataclasses.replace(
            read,
            memory_available_gb=max(0.0, min(read.memory_available_gb, offered)),
            measured_tokens_per_s=self.measured_tokens_per_s,
        )
