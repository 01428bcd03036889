"""A device's announced speed checked against the speed it measures on real work. Pure.

A device announces what it can do (FP32 TFLOPS, INT8 TOPS, memory bandwidth); a worker then
measures what it achieves on its model steps (FP32 GFLOP/s over the time the steps took).
Achieved is below peak by a factor, the device's *efficiency*, that is alike for devices doing
the same work. A device whose efficiency falls far below the fleet's overstates its speed, and
its claims are scaled down so that its measured speed wins:

* a device's ratio is measured GFLOP/s ÷ claimed GFLOP/s, the median of its last ``SAMPLES``
  measurements (one odd step does not move it);
* the reference is the upper median of the devices' ratios: a minority of liars cannot move it,
  and with one device alone there is nothing to check its claim against (scale 1);
* a device whose ratio is below reference ÷ ``TOLERANCE`` gets scale = ratio ÷ reference (a
  device claiming 10× its speed gets 0.1: its claims times 0.1 are what it measured); honest
  devices differ by less than ``TOLERANCE`` (claims drawn within a class, per-step overheads of
  small shards) and keep scale 1. A scale is never above 1: understating only hurts the device.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

#: Measurements per device the ratio is the median of.
SAMPLES = 3
#: How far below the fleet's efficiency a device may measure before its claims are scaled.
TOLERANCE = 3.0


def device_ratio(measured_gflops: Iterable[float], claimed_tflops: float) -> float | None:
    """Measured ÷ claimed FP32 speed (median of the measurements); None when unknown."""
    values = [m for m in measured_gflops if m > 0.0]
    if not values or claimed_tflops <= 0.0:
        return None
    return statistics.median(values) / (claimed_tflops * 1000.0)


def speed_scales(ratios: Mapping[str, float], tolerance: float = TOLERANCE) -> dict[str, float]:
    """The factor each device's claims are scaled by (1 for an honest device)."""
    if tolerance < 1.0:
        raise ValueError("tolerance must be at least 1")
    if len(ratios) < 2:
        return dict.fromkeys(ratios, 1.0)
    ordered = sorted(ratios.values())
    reference = ordered[len(ordered) // 2]
    return {
        device_id: ratio / reference if ratio * tolerance < reference else 1.0
        for device_id, ratio in ratios.items()
    }
