"""GPU readings through NVML (``nvidia-ml-py``): name, power, temperature and memory of GPU 0.

On a machine without an NVIDIA driver NVML does not load and ``read_gpu`` returns ``None``; the
worker then reports only what it measures itself (tokens per second, queue depth).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuReading:
    name: str
    power_w: float
    temperature_c: float
    memory_used_bytes: int
    memory_total_bytes: int


def read_gpu(index: int = 0) -> GpuReading | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: no GPU to read
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return GpuReading(
            name=name.decode() if isinstance(name, bytes) else str(name),
            power_w=pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            temperature_c=float(
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            ),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
        )
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
