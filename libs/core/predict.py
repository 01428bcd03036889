"""A placement's speed, predicted before it is made and corrected by what it then measures.

One decode step of ``streams`` requests at once runs every stage in turn (llama.cpp's RPC
split: the head sends each device its layers' work and waits): a stage's layers take the
longer of reading their weights once (``bytes / bandwidth``: a decode step on a CPU is bound by
memory at few streams) and computing every stream's token through them (``streams × FLOPs /
speed``); the last stage also runs the output layer; each stage after the first adds one round
trip of its link. A device's ``factor`` (1 until measured) scales its stages' time: after a
placement has served, ``corrected`` sets the factor of each of its devices from the measured
rate, and the default factor (``"*"``) of devices not measured yet, so the next prediction is
closer: for those devices, and for others on the same engine.

Time to first token: the prompt's tokens computed at once through every stage (bound by
compute), plus the round trips, plus one decode step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libs.core.catalogue import ModelSpec

#: Round trips of the link per stage per decode step (llama.cpp's RPC: the graph's compute
#: call and the result read back).
TRIPS_PER_STEP = 2


@dataclass(frozen=True, slots=True)
class Stage:
    """One device's part of a placement: its layers and what it measured of itself."""

    device_id: str
    layer_start: int
    layer_end: int
    #: FP32 GFLOP/s and memory bandwidth (GB/s), as calibrated on the device (in its quota).
    gflops: float
    bandwidth_gbps: float
    #: Round trip from the head to this device (ms); 0 for the head itself.
    rtt_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    #: Aggregate tokens/s at each number of streams at once.
    tokens_per_s: dict[int, float]
    ttft_ms: float


def factor_of(factors: Mapping[str, float], device_id: str) -> float:
    """The device's own factor, else the default one (``"*"``), else 1."""
    return factors.get(device_id, factors.get("*", 1.0))


def _stage_s(
    model: ModelSpec, stage: Stage, last: bool, tokens: int, factor: float, weights_once: bool
) -> float:
    """Seconds for ``tokens`` tokens through ``stage``'s layers (and the output layer)."""
    params = model.params_per_layer * (stage.layer_end - stage.layer_start)
    weight_gb = model.layers_gb(stage.layer_start, stage.layer_end, 0)
    if last:
        params += model.head_params
        weight_gb += (
            model.head_params * (model.embedding_bytes_per_param or model.bytes_per_param) / 1e9
        )
    compute_s = 2.0 * params * tokens / 1e9 / max(stage.gflops, 1e-9)
    memory_s = weight_gb / max(stage.bandwidth_gbps, 1e-9) if weights_once else 0.0
    return max(compute_s, memory_s) * factor


def step_s(
    model: ModelSpec,
    stages: Sequence[Stage],
    streams: int = 1,
    factors: Mapping[str, float] | None = None,
) -> float:
    """Seconds of one decode step of ``streams`` requests through ``stages`` (in order)."""
    factors = factors or {}
    total = 0.0
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        total += _stage_s(model, stage, last, streams, factor_of(factors, stage.device_id), True)
        total += TRIPS_PER_STEP * stage.rtt_ms / 1000.0
    return total


def predict(
    model: ModelSpec,
    stages: Sequence[Stage],
    streams: Sequence[int] = (1, 8),
    prompt_tokens: int = 64,
    factors: Mapping[str, float] | None = None,
) -> Prediction:
    """Tokens/s at each count of ``streams`` and the time to a first token of a prompt of
    ``prompt_tokens``."""
    if not stages:
        raise ValueError("a placement has at least one stage")
    rates = {n: n / step_s(model, stages, n, factors) for n in streams}
    factors = factors or {}
    prefill = sum(
        _stage_s(
            model, s, i == len(stages) - 1, prompt_tokens, factor_of(factors, s.device_id), False
        )
        + TRIPS_PER_STEP * s.rtt_ms / 1000.0
        for i, s in enumerate(stages)
    )
    return Prediction(rates, (prefill + step_s(model, stages, 1, factors)) * 1000.0)


def corrected(
    factors: Mapping[str, float], stages: Sequence[Stage], predicted: float, measured: float
) -> dict[str, float]:
    """``factors`` with each of ``stages``' devices scaled by how much slower (or faster) the
    placement measured than predicted (tokens/s, at the same streams), and the default of the
    devices never measured set to the same ratio where none was measured before."""
    if predicted <= 0 or measured <= 0:
        raise ValueError("rates must be positive")
    ratio = predicted / measured
    out = dict(factors)
    out.setdefault("*", ratio)
    for stage in stages:
        out[stage.device_id] = factor_of(factors, stage.device_id) * ratio
    return out
