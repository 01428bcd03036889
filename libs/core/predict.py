"""A placement's speed, predicted before it is made and corrected by what it then measures.

One decode step of ``streams`` requests at once runs every stage in turn (llama.cpp's RPC
split: the head sends each device its layers' work and waits). A stage reads its layers'
weights once (their bytes at a share of the memory bandwidth its device calibrated,
``READ_SHARE``) and computes their FLOPs for every stream's token at a share of the FP32 rate
it calibrated: each weight type at its kernels' own (``KERNELS``, where the file's types are
known), with each layer's other operations and, on the first stage, the tokens' own work
(``OP_GFLOP``, ``TOKEN_GFLOP``). Reading and computing are counted apart because they move
apart: a neighbour that takes the memory bus halves the first and leaves the second. A model
known by its sizes only runs at ``ENGINE_SHARE`` with a fixed part of ``STEP_TOKENS`` tokens.
The output layer runs on the first stage where the model ties it to the
embeddings (llama.cpp keeps that tensor where the embeddings are), else on the last; each stage
after the first adds ``TRIPS_PER_STEP`` round trips of its link. A device's ``factor`` (1 until
measured) scales its stages' time: after a placement has served, ``corrected`` sets the factor
of each of its devices for that model (``MODEL@DEVICE``) from the measured rate, and, where
none was measured before, the device's for other models (``DEVICE``), the model's on devices
not measured yet (``MODEL@*``) and everything's (``*``), so the next prediction is closer: the
most particular factor known is used (``factor_of``).

Time to first token: the prompt's tokens computed at once through every stage, plus the round
trips, plus one decode step. Watts: each device's idle draw, plus its span to full load for the
share of a step it computes, from the draws it reports (its class's where it has no meter: the
prediction is as good as they are, and nothing here measures watts to check it).

The constants were fitted to llama.cpp's CPU build: ``KERNELS``, ``READ_SHARE`` and the
per-operation and per-token parts to 52 made models of 13 weight types on one held core
(``bench/kernel_rates.py``), ``ENGINE_SHARE`` and ``STEP_TOKENS`` to 15 placements of a Q8_0
model (``bench/placement.py``); another engine or machine starts from them and corrects itself
by its first measurement.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from libs.core.catalogue import ModelSpec
from libs.core.model import Device

#: Round trips of the link per stage per decode step (llama.cpp's RPC: the graph's compute
#: call and the result read back).
TRIPS_PER_STEP = 2
#: The torch ring's: each stage sends its activations on, one hop per stage per token. Its
#: compute is counted with llama.cpp's constants, not fitted to it: its estimate weighs its own
#: splits and compares it with llama.cpp's, but is not shown as a prediction.
RING_TRIPS_PER_STEP = 1
#: The share of a device's calibrated FP32 GFLOP/s that llama.cpp's CPU kernels reach.
ENGINE_SHARE = 0.30
#: A step's fixed part, as tokens' worth of compute (its weights read once per step).
STEP_TOKENS = 0.26
#: Bytes per weight of each of ggml's types (its block's bytes over its weights).
BYTES_PER_WEIGHT: dict[str, float] = {
    "F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32,
    "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q2_K": 84 / 256, "Q3_K": 110 / 256, "Q4_K": 144 / 256,
    "Q5_K": 176 / 256, "Q6_K": 210 / 256, "Q8_K": 292 / 256, "IQ4_XS": 136 / 256,
    "IQ4_NL": 18 / 32,
}  # fmt: skip
#: Each weight type's kernels in llama.cpp's CPU build, fitted to made models run whole on one
#: held core (``bench/kernel_rates.py``, ``bench/results/kernel_rates.md``): the share of the
#: calibrated FP32 GFLOP/s its matrix products reach per token.
KERNELS: dict[str, float] = {
    "F32": 0.588, "F16": 0.44, "BF16": 0.448, "Q8_0": 0.591, "Q4_0": 0.539, "Q4_1": 0.381,
    "Q5_0": 0.392, "Q5_1": 0.315, "Q3_K": 0.378, "Q4_K": 0.628, "Q5_K": 0.377, "Q6_K": 0.331,
    "IQ4_XS": 0.362,
}  # fmt: skip
#: A type not measured, in a file whose types are known: the measured types' median.
OTHER_KERNEL = statistics.median(KERNELS.values())
#: The share of the calibrated memory bandwidth (a copy's: read and write) at which a step
#: reads its weights, fitted with ``KERNELS``.
READ_SHARE = 1.386
#: A device whose bandwidth is unknown: this many GB/s per calibrated GFLOP/s (the fit's).
GBPS_PER_GFLOPS = 0.157
#: A layer's work besides its matrices (norms, attention, rope, the graph's own), GFLOP at
#: the calibrated rate per step and per stream; and the tokens' work outside the graph
#: (sampling, the server's), on the first stage. Fitted with ``KERNELS``.
OP_GFLOP = (0.0, 0.00396)
TOKEN_GFLOP = (0.0, 0.05287)


@dataclass(frozen=True, slots=True)
class Stage:
    """One device's part of a placement: its layers and the speed it calibrated."""

    device_id: str
    layer_start: int
    layer_end: int
    #: FP32 GFLOP/s, as calibrated on the device (inside its quota, where it has one).
    gflops: float
    #: Round trip from the head to this device (ms); 0 for the head itself.
    rtt_ms: float = 0.0
    #: Memory bandwidth (GB/s), as calibrated there; 0: unknown (``GBPS_PER_GFLOPS``).
    memory_gbps: float = 0.0
    #: The device's draw idle and at full load (W), as it reports them.
    idle_w: float = 0.0
    max_w: float = 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    #: Aggregate tokens/s at each number of streams at once.
    tokens_per_s: dict[int, float]
    ttft_ms: float
    #: The placement's devices' draw while serving that many streams (W): each device idle,
    #: plus its span from idle to full load for the share of a step it computes.
    watts: dict[int, float] = field(default_factory=dict)


def factor_of(factors: Mapping[str, float], device_id: str, model: str = "") -> float:
    """The factor for ``model`` on ``device_id``: measured so (``MODEL@DEVICE``), else the
    device's on other models, else the model's on other devices (``MODEL@*``), else the
    default (``*``), else 1."""
    for key in (f"{model}@{device_id}", device_id, f"{model}@*", "*"):
        if key in factors:
            return factors[key]
    return 1.0


def _matrices_s(
    params: float,
    types: Sequence[tuple[str, float]],
    tokens: int,
    rate: float,
    bandwidth: float,
    size: float,
) -> float:
    """Seconds for ``tokens`` tokens at once through ``params`` weights of ``types`` (each
    type's share of them; none known: the default kernel) at ``rate`` GFLOP/s, their bytes
    read once at ``bandwidth`` GB/s (a type of unknown size: ``size`` bytes per weight)."""
    if not types:  # sizes only (a catalogue model, the torch ring)
        return 2.0 * params * (STEP_TOKENS + tokens) / 1e9 / (rate * ENGINE_SHARE)
    total = 0.0
    for name, part in types:
        weights = params * part
        total += weights * BYTES_PER_WEIGHT.get(name, size) / 1e9 / (bandwidth * READ_SHARE)
        total += 2.0 * weights * tokens / 1e9 / (rate * KERNELS.get(name, OTHER_KERNEL))
    return total


def _stage_s(
    model: ModelSpec, stages: Sequence[Stage], i: int, tokens: int, factor: float
) -> float:
    """Seconds for ``tokens`` tokens at once through stage ``i``'s layers (and the output
    layer, where it runs there; and the tokens' own work, on the first)."""
    stage = stages[i]
    layers = stage.layer_end - stage.layer_start
    rate = max(stage.gflops, 1e-9)
    bandwidth = stage.memory_gbps or rate * GBPS_PER_GFLOPS
    size = model.bytes_per_param
    seconds = _matrices_s(
        model.params_per_layer * layers, model.layer_types, tokens, rate, bandwidth, size
    )
    if i == (0 if model.tied else len(stages) - 1):
        head = ((model.output_type, 1.0),) if model.output_type else ()
        seconds += _matrices_s(model.head_params, head, tokens, rate, bandwidth, size)
    if model.layer_types:  # a llama.cpp file: its operations and tokens as measured
        seconds += layers * (OP_GFLOP[0] + OP_GFLOP[1] * tokens) / rate
        if i == 0:
            seconds += (TOKEN_GFLOP[0] + TOKEN_GFLOP[1] * tokens) / rate
    return seconds * factor


def step_s(
    model: ModelSpec,
    stages: Sequence[Stage],
    streams: int = 1,
    factors: Mapping[str, float] | None = None,
    trips: int = TRIPS_PER_STEP,
) -> float:
    """Seconds of one decode step of ``streams`` requests through ``stages`` (in order), each
    stage's link crossed ``trips`` times there and back."""
    factors = factors or {}
    total = 0.0
    for i, stage in enumerate(stages):
        total += _stage_s(
            model, stages, i, streams, factor_of(factors, stage.device_id, model.name)
        )
        total += trips * stage.rtt_ms / 1000.0
    return total


def stages_of(devices: Sequence[Device], counts: Sequence[int]) -> list[Stage]:
    """The stages of ``counts`` layers on ``devices`` in pipeline order: each device's speed,
    and its round trip from the head (the first device)."""
    ends = list(accumulate(counts))
    return [
        Stage(d.device_id, end - n, end, d.speed, d.network_rtt_ms if i else 0.0,
              d.memory_gbps, d.power_idle_w, d.power_max_w)
        for i, (d, n, end) in enumerate(zip(devices, counts, ends, strict=True))
    ]  # fmt: skip


def placement_step_ms(
    model: ModelSpec,
    devices: Sequence[Device],
    counts: Sequence[int],
    trips: int = TRIPS_PER_STEP,
) -> float:
    """One stream's decode step (ms) of ``counts`` layers on ``devices``: the placement's
    estimate (``partition.Step``), llama.cpp's split by default."""
    return step_s(model, stages_of(devices, counts), trips=trips) * 1000.0


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
    prefill = step_s(model, stages, prompt_tokens, factors)  # the prompt's tokens at once
    ttft_ms = (prefill + step_s(model, stages, 1, factors)) * 1000.0
    return Prediction(rates, ttft_ms, {n: watts(model, stages, n, factors) for n in streams})


def watts(
    model: ModelSpec,
    stages: Sequence[Stage],
    streams: int = 1,
    factors: Mapping[str, float] | None = None,
) -> float:
    """The draw of ``stages``' devices while they serve ``streams`` at once: each idle, plus
    its span to full load for the share of a step it computes (the rest of the step it
    waits on the others and the links)."""
    factors = factors or {}
    step = step_s(model, stages, streams, factors)
    total = 0.0
    for i, stage in enumerate(stages):
        factor = factor_of(factors, stage.device_id, model.name)
        busy = _stage_s(model, stages, i, streams, factor) / step
        total += stage.idle_w + (stage.max_w - stage.idle_w) * min(1.0, busy)
    return total


def corrected(
    factors: Mapping[str, float],
    stages: Sequence[Stage],
    predicted: float,
    measured: float,
    model: str = "",
) -> dict[str, float]:
    """``factors`` with ``model`` on each of ``stages``' devices scaled by how much slower (or
    faster) the placement measured than predicted (tokens/s, at the same streams); where none
    was known before, the same factor for the device on other models, for the model on devices
    never measured, and for everything."""
    if predicted <= 0 or measured <= 0:
        raise ValueError("rates must be positive")
    ratio = predicted / measured
    out = dict(factors)
    found = []
    for stage in stages:
        factor = factor_of(factors, stage.device_id, model) * ratio
        out[f"{model}@{stage.device_id}"] = factor
        out.setdefault(stage.device_id, factor)
        found.append(factor)
    typical = math.prod(found) ** (1.0 / len(found)) if found else ratio  # geometric mean
    out.setdefault(f"{model}@*", typical)
    out.setdefault("*", typical)
    return out
