"""A worker's GPU as its device (the vLLM worker where NVML answers): nothing emulated but its
speed. Its class is ``cloud_gpu``; its memory is the GPU's (NVML's total), its power limit the
one the driver enforces; each sample's load, power, temperature and free memory are NVML's
readings of GPU 0 (a reading NVML refuses is sent as none). NVML reports no FLOP/s, so the
speed announced is the class's, as an emulated device's is, until the worker measures its own.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from libs.contracts import DeviceAnnounce, DeviceClass
from libs.devices.emulated import EmulatedDevice, Readings
from libs.devices.host_device import gpu_sample

log = logging.getLogger(__name__)


def power_limit_w(nvml: Any) -> float | None:
    """GPU 0's power limit as the driver enforces it, watts (None: NVML does not say)."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        return float(nvml.nvmlDeviceGetEnforcedPowerLimit(handle)) / 1000.0
    except Exception:
        return None


@dataclasses.dataclass
class GpuDevice(EmulatedDevice):
    """GPU 0 of this host, read through ``nvml`` (``pynvml``, initialised)."""

    nvml: Any = None

    @classmethod
    def probe(
        cls, device_id: str, nvml: Any | None, rng: np.random.Generator, now: float = 0.0
    ) -> GpuDevice | None:
        """The GPU as a device, or None where NVML reads no GPU."""
        first = gpu_sample(nvml) if nvml is not None else None
        if nvml is None or first is None:
            return None
        base = EmulatedDevice.draw(device_id, DeviceClass.CLOUD_GPU, rng, now)
        caps = base.capabilities
        limit = power_limit_w(nvml) or caps.max_power_w
        count = int(nvml.nvmlDeviceGetCount())
        update = {
            "memory_total_gb": first.memory_total_gb,
            "gpu_count": count,
            "max_power_w": limit,
            "typical_power_w": min(caps.typical_power_w, limit),
        }
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        device = cls(**{**fields, "capabilities": caps.model_copy(update=update)}, nvml=nvml)
        for reading in ("memory", "power", "temperature"):  # NVML's
            device.sources[reading] = "measured"
        log.info(
            "this worker's GPU is the device",
            extra={"device_id": device_id, "memory_gb": round(first.memory_total_gb, 1)},
        )
        return device

    def step(self, dt: float, now: float) -> None:
        """Nothing to emulate: the readings are the GPU's."""

    def announce(self, now: float, interval_s: float) -> DeviceAnnounce:
        return super().announce(now, interval_s).model_copy(update={"emulated": False})

    def read(self, now: float, rng: np.random.Generator) -> Readings:
        """NVML's readings now. The memory offered is what the placement's shards leave of
        the GPU's, and no more than NVML finds free while this device runs nothing (another
        program's use counts; once a model is placed here, its server's own reservation,
        vLLM's share of the GPU, is what the placement counted)."""
        sample = gpu_sample(self.nvml)
        offered = max(0.0, self.memory_limit_gb - self.reserved_memory_gb)
        if sample is None:  # NVML stopped answering: nothing measured this time
            return Readings(0.0, offered, None, None, None, None)
        free = max(0.0, sample.memory_total_gb - sample.memory_used_gb)
        return Readings(
            cpu_utilisation=sample.utilisation,
            memory_available_gb=offered if self.work else min(free, offered),
            power_w=sample.power_w,
            temperature_c=sample.temperature_c,
            battery_percent=None,
            plugged=None,
            gpu=sample,
            measured_tokens_per_s=self.measured_tokens_per_s,
        )
