"""The five capability dimensions of a device (compute, memory, efficiency, network, stability),
each normalised to [0, 1].

Normalisation (fixed reference bounds, so a device's score does not move when another device
joins the fleet):

* Raw quantities spanning orders of magnitude (TFLOPS, TOPS, GB/s, Mbit/s, score per watt) go
  through ``log_scale``: 0 at or below ``low``, 1 at or above ``high``, logarithmic between.
* CCI = α·log(FP32 TFLOPS) + β·log(INT8 TOPS) + γ·log(memory GB/s), with α+β+γ = 1 chosen by
  the model type (float-heavy: α up; quantised: β up).
* MBS = min(1, available memory / model memory need) × memory bandwidth score, the latter by
  memory type (HBM > GDDR6 > LPDDR5 > DDR5 > DDR4 > LPDDR4).
* PER = FP32 GFLOP/s per watt of typical power, log-scaled between 1 and 1000 (a watch about
  20, phones, laptops and workstations 100–300, the best accelerators toward 1000). The first
  design's CCI ÷ watts divided a log-scaled score by watts, which ranked a 1 W watch the most
  efficient device of any fleet; FLOP/s per watt is what a device really delivers per joule.
* NLB = log(bandwidth Mbit/s) × exp(−latency / 10 ms).
* DSS = uptime ratio × (1 − failure rate), both already fractions.
* Total = w1·CCI + w2·MBS + w3·PER + w4·NLB + w5·DSS with Σw = 1 (weights from the mode).

All functions accept floats or numpy arrays (vectorised scoring of a whole fleet).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

from libs.contracts import MemoryType

Num = TypeVar("Num", float, npt.NDArray[np.float64])

#: CCI mixing weights (α, β, γ) by model type.
CCI_WEIGHTS: dict[str, tuple[float, float, float]] = {
    "float": (0.6, 0.2, 0.2),
    "quantised": (0.2, 0.6, 0.2),
    "balanced": (0.4, 0.4, 0.2),
}

#: Reference bounds (low, high) of the log scales.
FP32_TFLOPS_RANGE = (0.005, 200.0)
INT8_TOPS_RANGE = (0.01, 2000.0)
BANDWIDTH_GBPS_RANGE = (5.0, 5000.0)
NETWORK_MBPS_RANGE = (1.0, 10_000.0)
PER_RANGE = (1.0, 1000.0)  # GFLOP/s per watt
LATENCY_SCALE_MS = 10.0

MEMORY_TYPE_SCORE: dict[MemoryType, float] = {
    MemoryType.HBM: 1.0,
    MemoryType.GDDR6: 0.95,
    MemoryType.LPDDR5: 0.85,
    MemoryType.DDR5: 0.75,
    MemoryType.DDR4: 0.55,
    MemoryType.LPDDR4: 0.4,
}


def log_scale(value: Num, low: float, high: float) -> Num:
    """0 at or below ``low``, 1 at or above ``high``, log-linear between. Monotone."""
    clipped = np.clip(value, low, high)
    return np.log(clipped / low) / np.log(high / low)  # type: ignore[no-any-return, return-value, unused-ignore]


def compute_index(
    fp32_tflops: Num, int8_tops: Num, bandwidth_gbps: Num, model_type: str = "balanced"
) -> Num:
    """CCI in [0, 1]."""
    alpha, beta, gamma = CCI_WEIGHTS[model_type]
    return (  # type: ignore[no-any-return, return-value, unused-ignore]
        alpha * log_scale(fp32_tflops, *FP32_TFLOPS_RANGE)
        + beta * log_scale(int8_tops, *INT8_TOPS_RANGE)
        + gamma * log_scale(bandwidth_gbps, *BANDWIDTH_GBPS_RANGE)
    )


def memory_score(available_gb: Num, need_gb: float, memory_type: MemoryType) -> Num:
    """MBS in [0, 1]; ``need_gb`` > 0 is the task's model memory need."""
    if need_gb <= 0:
        raise ValueError("need_gb must be positive")
    return np.minimum(1.0, np.maximum(available_gb, 0.0) / need_gb) * MEMORY_TYPE_SCORE[memory_type]  # type: ignore[no-any-return, return-value, unused-ignore]


def efficiency_score(fp32_tflops: Num, typical_power_w: Num) -> Num:
    """PER in [0, 1]: FP32 GFLOP/s per watt of typical power, log-scaled."""
    per_watt = np.asarray(fp32_tflops) * 1000.0 / np.maximum(typical_power_w, 1e-9)
    return log_scale(per_watt, *PER_RANGE)  # type: ignore[no-any-return, return-value, unused-ignore]


def network_score(bandwidth_mbps: Num, latency_ms: Num) -> Num:
    """NLB in [0, 1]: bandwidth score × exp(−latency / 10 ms)."""
    return log_scale(bandwidth_mbps, *NETWORK_MBPS_RANGE) * np.exp(  # type: ignore[no-any-return, return-value, unused-ignore]
        -np.maximum(latency_ms, 0.0) / LATENCY_SCALE_MS
    )


def stability_score(uptime_ratio: Num, failure_rate: Num) -> Num:
    """DSS in [0, 1]: uptime ratio × (1 − failure rate)."""
    return np.clip(uptime_ratio, 0.0, 1.0) * (1.0 - np.clip(failure_rate, 0.0, 1.0))  # type: ignore[no-any-return, return-value, unused-ignore]


def total_score(dimensions: npt.ArrayLike, weights: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Σ w_i·dim_i over the last axis; ``weights`` (w1..w5) must sum to 1."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (5,) or abs(w.sum() - 1.0) > 1e-6 or (w < 0).any():
        raise ValueError("weights must be five non-negative numbers summing to 1")
    return np.asarray(dimensions, dtype=np.float64) @ w
