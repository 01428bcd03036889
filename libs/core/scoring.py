"""Score a batch of devices at once: the five dimensions and the total.

Inputs are arrays over the batch; see ``capability.py`` for each formula and its
normalisation. Stability comes from history: uptime ratio = 1 − down time / observed time,
failure rate = failures per hour / ``FAILURES_PER_HOUR_FOR_ZERO`` (capped at 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from libs.contracts.keys import SCORE_FIELDS
from libs.core import capability as cap

F64 = npt.NDArray[np.float64]
FAILURES_PER_HOUR_FOR_ZERO = 10.0


@dataclass(frozen=True, slots=True)
class Dimensions:
    compute: F64
    memory: F64
    efficiency: F64
    network: F64
    stability: F64
    total: F64

    def row(self, i: int) -> dict[str, float]:
        return {name: float(getattr(self, name)[i]) for name in DIMENSION_FIELDS}


DIMENSION_FIELDS = SCORE_FIELDS  # the fields of a device's Redis row, in this order


def uptime_and_failure_rate(observed_s: F64, down_s: F64, failures: F64) -> tuple[F64, F64]:
    observed = np.maximum(observed_s, 1.0)
    uptime = np.clip(1.0 - down_s / observed, 0.0, 1.0)
    per_hour = failures * 3600.0 / np.maximum(observed, 3600.0)
    return uptime, np.minimum(1.0, per_hour / FAILURES_PER_HOUR_FOR_ZERO)


def score_batch(
    *,
    compute: F64,
    fp32_tflops: F64,
    memory_type_score: F64,
    typical_power_w: F64,
    memory_available_gb: F64,
    network_bandwidth_mbps: F64,
    network_rtt_ms: F64,
    uptime_ratio: F64,
    failure_rate: F64,
    weights: tuple[float, float, float, float, float],
    reference_need_gb: float = 2.0,
) -> Dimensions:
    """``compute`` is CCI (already in [0, 1], static per device) and ``fp32_tflops`` the speed
    behind it (for efficiency, FLOP/s per watt); the memory dimension is the
    device part of MBS against ``reference_need_gb`` (the model's own need applies at
    placement)."""
    memory = np.minimum(1.0, np.maximum(memory_available_gb, 0.0) / reference_need_gb)
    memory = memory * memory_type_score
    efficiency = cap.efficiency_score(fp32_tflops, typical_power_w)
    network = cap.network_score(network_bandwidth_mbps, network_rtt_ms)
    stability = cap.stability_score(uptime_ratio, failure_rate)
    dims = np.stack([compute, memory, efficiency, network, stability], axis=-1)
    total = cap.total_score(dims, weights)
    return Dimensions(compute, memory, efficiency, network, stability, total)
