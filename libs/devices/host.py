"""This host as a worker's device (``tessera join``): nothing emulated.

Its memory, battery, temperature and load are read from the host (psutil), its speed is what
``tessera calibrate`` measured here, and its power is read where the host exposes it (RAPL
energy counters, or a battery's discharge); where it exposes neither, the power is an estimate
from the core count and the load, and the device's announcement says it is not measured.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from libs.contracts import Capabilities, DeviceAnnounce, DeviceClass, MemoryType, TelemetrySample
from libs.devices.calibration import Calibration
from libs.devices.emulated import EmulatedDevice

log = logging.getLogger(__name__)
GB = 1e9
WATTS_PER_CORE = 10.0  #: the typical-power estimate where nothing measures it
RAPL = Path("/sys/class/powercap")


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


@dataclasses.dataclass
class HostDevice(EmulatedDevice):
    """The host itself; ``step`` emulates nothing and ``sample`` reads the host."""

    meter: PowerMeter = dataclasses.field(default_factory=PowerMeter)

    @classmethod
    def probe(
        cls, device_id: str, calibration: Calibration, memory_gb: float | None = None
    ) -> HostDevice:
        caps = host_capabilities(calibration)
        if memory_gb is not None:
            caps = caps.model_copy(update={"memory_total_gb": memory_gb})
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
        )
        psutil.cpu_percent(interval=None)  # primes the load counter
        measured = "RAPL" if device.meter.measures else "not measured (estimated from the load)"
        log.info(
            "this host is the device",
            extra={"device_id": device_id, "host": socket.gethostname(), "power": measured},
        )
        return device

    def step(self, dt: float, now: float) -> None:
        """Nothing to emulate: the readings are the host's."""

    def announce(self, now: float, interval_s: float) -> DeviceAnnounce:
        return super().announce(now, interval_s).model_copy(update={"emulated": False})

    def sample(self, seq: int, now: float, rng: np.random.Generator) -> TelemetrySample:
        memory, battery = psutil.virtual_memory(), psutil.sensors_battery()
        load = min(1.0, psutil.cpu_percent(interval=None) / 100.0)
        caps = self.capabilities
        watts = self.meter.watts()
        if watts is None:
            watts = caps.typical_power_w * (0.25 + 0.75 * load)
        heat = temperature_c()
        return TelemetrySample(
            device_id=self.device_id,
            seq=seq,
            ts=now,
            cpu_utilisation=load,
            memory_total_gb=caps.memory_total_gb,
            memory_available_gb=max(
                0.0, min(memory.available / GB, caps.memory_total_gb - self.reserved_memory_gb)
            ),
            power_w=min(watts, caps.max_power_w * 4),
            temperature_c=heat if heat is not None else 40.0,
            battery_percent=battery.percent if battery else None,
            plugged=bool(battery.power_plugged) if battery else None,
            network_rtt_ms=self.base_rtt_ms,
            network_bandwidth_mbps=caps.network_bandwidth_mbps,
            running_tasks=len(self.work),
            queue_depth=self.queue_depth,
            measured_tokens_per_s=self.measured_tokens_per_s,
            measured_gflops=self.measured_gflops,
        )
