"""Split a model's layers into contiguous shards across devices (exo's core idea).

Two splits are weighed for each set of devices: the balanced one (layers in proportion to
each device's capacity, half free memory share, half speed share, rounded by largest remainder
with at least one layer each, then moved off any device whose share does not fit its memory)
and the fastest one (each device in turn, fastest first, takes as many layers as its memory
holds: a decode step runs the stages one after another, so a layer costs least on the fastest
device). The fastest is kept where its estimated step is at least ``FASTER_BY`` shorter, so
that devices whose speeds differ only by their calibration's noise keep balanced memory.

The step's estimate is the caller's (``Step``): ``step_ms`` here, compute over each device's
speed plus a round trip per hop; the scheduler passes the engine's fitted model
(``libs/core/predict.py``) where it has one. ``previews`` lists every candidate (the k most
capable devices, k = 1..max) with per-device layers and memory, or the reason it fails; the
chosen option is the feasible one with the smallest estimated per-token step time, where
every extra hop costs the network round trip — so a poor network prefers fewer devices, and a
model that fits whole on a device faster than any split stays whole.

A device whose engine offloads layers to a GPU (``Device.vram_free_gb``) holds its shard in its
VRAM and host memory together, counted apart: the shard's last layers that fit the VRAM are its
``gpu_layers`` and ``vram_gb``, the rest its ``memory_gb`` (``room_gb``, ``host_gb``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise

from libs.contracts import DEFAULT_CONTEXT_TOKENS
from libs.core.catalogue import GB, ModelSpec
from libs.core.model import Device

#: How much shorter (a fraction of its step) the fastest split must be estimated than the
#: balanced one to be chosen over it.
FASTER_BY = 0.05


@dataclass(frozen=True, slots=True)
class ShardPlan:
    device_id: str
    shard_index: int
    layer_start: int
    layer_end: int
    #: Host memory the shard takes, and the part of it held in the device's VRAM instead.
    memory_gb: float
    vram_gb: float = 0.0
    #: Its last layers held in the VRAM (``gpu_part``; the last shard's output layer is one).
    gpu_layers: int = 0

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True)
class Preview:
    """One candidate placement: its shards, or why it is infeasible."""

    model: str
    devices: tuple[str, ...]
    shards: tuple[ShardPlan, ...]
    feasible: bool
    reason: str | None
    step_ms: float | None


def largest_remainder(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """Integers summing to ``total``, proportional to ``weights``, each at least ``minimum``."""
    n = len(weights)
    if n == 0 or total < minimum * n:
        raise ValueError(f"cannot give {n} parts at least {minimum} of {total}")
    spare = total - minimum * n
    weight_sum = sum(weights)
    shares = [spare * w / weight_sum if weight_sum > 0 else spare / n for w in weights]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(n), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: spare - sum(counts)]:
        counts[i] += 1
    return [c + minimum for c in counts]


def room_gb(device: Device) -> float:
    """What a shard may take on ``device``: its free host memory and its free VRAM."""
    return device.memory_free_gb + device.vram_free_gb


def output_gb(model: ModelSpec) -> float:
    """The output layer's weights (a tied model's is its embedding matrix), GB."""
    params = model.embedding_params if model.tied else model.head_params
    return params * model.embedding_bytes / GB


def gpu_part(
    model: ModelSpec, start: int, end: int, output: bool, context_length: int, vram_gb: float
) -> tuple[int, float]:
    """What a shard of layers ``start`` to ``end - 1`` (``output``: and the output layer, the
    last shard's) holds in ``vram_gb`` of GPU memory: how many layers, counted from its last as
    llama.cpp offloads them (the output layer first, and one of them), and the GB they take
    with their KV cache."""
    if vram_gb <= 0:
        return 0, 0.0
    count, used = 0, 0.0
    if output:
        if output_gb(model) > vram_gb:
            return 0, 0.0
        count, used = 1, output_gb(model)
    for layer in reversed(range(start, end)):
        size = model.layers_gb(layer, layer + 1, context_length)
        if used + size > vram_gb + 1e-9:
            break
        count, used = count + 1, used + size
    return count, used


def gpu_held_gb(
    model: ModelSpec, start: int, end: int, output: bool, context_length: int, count: int
) -> float:
    """The GB the last ``count`` layers of a shard of layers ``start`` to ``end - 1`` take on
    its GPU (``output``: the output layer the first of them), as ``gpu_part`` put them."""
    if count <= 0:
        return 0.0
    held = output_gb(model) if output else 0.0
    layers = count - 1 if output else count
    return held + model.layers_gb(max(start, end - layers), end, context_length)


def capacity_weights(devices: Sequence[Device]) -> list[float]:
    rooms = [room_gb(d) for d in devices]
    memory = sum(rooms) or 1.0
    speed = sum(d.speed for d in devices) or 1.0
    return [0.5 * r / memory + 0.5 * d.speed / speed for r, d in zip(rooms, devices, strict=True)]


def _max_layers(model: ModelSpec, device: Device, first: bool, last: bool, ctx: int) -> int:
    """The most layers of the mean size ``device`` holds as a shard: in host memory and in its
    VRAM (``gpu_part``: the last shard's output layer too)."""
    fixed = model.shard_gb(0, first, last, ctx)
    on_gpu = 0
    if device.vram_free_gb > 0:
        on_gpu = gpu_part(model, 0, model.layers, last, ctx, device.vram_free_gb)[0]
        if last and on_gpu:  # the output layer among them, out of host memory (a tied
            on_gpu -= 1  # model's, where the embeddings are here too, is a copy)
            fixed -= 0.0 if model.tied and first else output_gb(model)
    room = device.memory_free_gb - fixed
    if room < 0:
        return 0
    return math.floor(room / model.layer_gb(ctx) + 1e-9) + on_gpu


def host_gb(
    model: ModelSpec, device: Device, start: int, end: int, first: bool, last: bool, ctx: int
) -> tuple[float, int, float]:
    """A shard of layers ``start`` to ``end - 1`` on ``device``: the host memory it takes, and
    what of it sits in the VRAM instead (``gpu_part``: layers, GB)."""
    memory = model.shard_gb(end - start, first, last, ctx, start)
    on_gpu, held = gpu_part(model, start, end, last, ctx, device.vram_free_gb)
    if first and last and model.tied and on_gpu:  # the GPU's output layer: a copy of the
        memory += output_gb(model)  # embeddings, which stay in host memory too
    return memory - held, on_gpu, held


def split_layers(
    model: ModelSpec, devices: Sequence[Device], context_length: int
) -> tuple[list[int] | None, str | None]:
    """Layer counts per device (in order), or None with the reason."""
    n = len(devices)
    if n > model.layers:
        return None, f"{n} devices but only {model.layers} layers"
    limits = [
        _max_layers(model, d, i == 0, i == n - 1, context_length) for i, d in enumerate(devices)
    ]
    counts: list[int] | None = None
    if sum(limits) >= model.layers and min(limits) >= 1:
        counts = largest_remainder(model.layers, capacity_weights(devices))
        # Move layers off devices over their limit onto those with room, most room first.
        for _ in range(model.layers):
            over = [i for i in range(n) if counts[i] > limits[i]]
            if not over:
                break
            i = over[0]
            room = [(limits[j] - counts[j], j) for j in range(n) if counts[j] < limits[j]]
            j = max(room)[1]
            counts[i] -= 1
            counts[j] += 1
    if model.layer_bytes:  # layers of their own sizes: the limits above counted the mean
        counts = fit_ranges(model, devices, counts, context_length)
    if counts is None:
        need = model.shard_gb(model.layers, True, True, context_length)
        short = [d.device_id for d, lim in zip(devices, limits, strict=True) if lim < 1]
        if short:
            return None, f"memory: {', '.join(short)} cannot hold even one layer"
        free = sum(room_gb(d) for d in devices)
        vram = " (VRAM too)" if any(d.vram_free_gb > 0 for d in devices) else ""
        return (
            None,
            f"memory: needs about {need:.2f} GB, these devices have {free:.2f} GB{vram} free",
        )
    return counts, None


def fit_ranges(
    model: ModelSpec, devices: Sequence[Device], counts: list[int] | None, context_length: int
) -> list[int] | None:
    """``counts`` where each device holds its own layers' bytes; else the cuts nearest to them
    (or to the capacity shares) that fit, or None when no contiguous split is found.

    From the end, each device takes as many layers as fit (``lowest[i]``: the first layer
    devices i.. can start at and hold the rest); then from the start each device ends at its
    wanted cut, moved only as far as needed: no further than fits, no earlier than the rest
    can hold."""
    n, total = len(devices), model.layers

    def fits(i: int, start: int, end: int) -> bool:
        host = host_gb(model, devices[i], start, end, i == 0, i == n - 1, context_length)[0]
        return host <= devices[i].memory_free_gb + 1e-9

    if counts and all(
        fits(i, end - count, end)
        for i, (end, count) in enumerate(zip(accumulate(counts), counts, strict=True))
    ):
        return counts
    lowest = [0] * n + [total]
    for i in reversed(range(n)):
        start = lowest[i + 1] - 1
        if start < i or not fits(i, start, lowest[i + 1]):
            return None
        while start > i and fits(i, start - 1, lowest[i + 1]):
            start -= 1
        lowest[i] = start
    if lowest[0] > 0:
        return None
    wanted = counts or largest_remainder(total, capacity_weights(devices))
    cuts, start = [], 0
    for i in range(n - 1):
        end = max(start + 1, lowest[i + 1], min(start + wanted[i], total - (n - 1 - i)))
        while end > max(start + 1, lowest[i + 1]) and not fits(i, start, end):
            end -= 1
        if not fits(i, start, end):  # no cut near the wanted one: the split from the end
            return [b - a for a, b in pairwise(lowest)]
        cuts.append(end - start)
        start = end
    if not fits(n - 1, start, total):
        return [b - a for a, b in pairwise(lowest)]
    return [*cuts, total - start]


def fastest_split(
    model: ModelSpec, devices: Sequence[Device], context_length: int
) -> list[int] | None:
    """Layer counts per device (in order) where each device, fastest first, takes as many
    layers as its memory holds (the others keeping one each); None where they cannot hold
    the model."""
    n = len(devices)
    if n > model.layers:
        return None
    limits = [
        _max_layers(model, d, i == 0, i == n - 1, context_length) for i, d in enumerate(devices)
    ]
    if min(limits) < 1 or sum(limits) < model.layers:
        return None
    counts, spare = [1] * n, model.layers - n
    for i in sorted(range(n), key=lambda i: (-devices[i].speed, i)):
        more = min(limits[i] - 1, spare)
        counts[i] += more
        spare -= more
    if model.layer_bytes:  # layers of their own sizes: the limits above counted the mean
        return fit_ranges(model, devices, counts, context_length)
    return counts


#: A placement's estimated step (ms): the model, its devices in order, the layers of each.
Step = Callable[[ModelSpec, Sequence[Device], Sequence[int]], float]


def plan(
    model: ModelSpec,
    devices: Sequence[Device],
    context_length: int = DEFAULT_CONTEXT_TOKENS,
    step: Step | None = None,
) -> Preview:
    """The shards of ``model`` over exactly ``devices`` (in pipeline order): the balanced
    split, or the fastest where ``step`` estimates it ``FASTER_BY`` shorter."""
    step = step or step_ms
    counts, reason = split_layers(model, devices, context_length)
    if counts is None:
        ids = tuple(d.device_id for d in devices)
        return Preview(model.name, ids, (), False, reason, None)
    balanced = _preview(model, devices, counts, context_length, step)
    fastest = fastest_split(model, devices, context_length)
    if fastest is None or fastest == counts:
        return balanced
    quick = _preview(model, devices, fastest, context_length, step)
    assert quick.step_ms is not None and balanced.step_ms is not None
    return quick if quick.step_ms < (1.0 - FASTER_BY) * balanced.step_ms else balanced


def _preview(
    model: ModelSpec,
    devices: Sequence[Device],
    counts: Sequence[int],
    context_length: int,
    step: Step | None = None,
) -> Preview:
    """The feasible preview of ``counts`` layers on ``devices``, in pipeline order."""
    shards, start = [], 0
    for index, (device, layers) in enumerate(zip(devices, counts, strict=True)):
        first, last = index == 0, index == len(devices) - 1
        end = start + layers
        host, on_gpu, vram = host_gb(model, device, start, end, first, last, context_length)
        shard = ShardPlan(device.device_id, index, start, start + layers, round(host, 4))
        shards.append(replace(shard, vram_gb=round(vram, 4), gpu_layers=on_gpu))
        start += layers
    ids = tuple(d.device_id for d in devices)
    estimate = (step or step_ms)(model, devices, counts)
    return Preview(model.name, ids, tuple(shards), True, None, estimate)


def step_ms(model: ModelSpec, devices: Sequence[Device], counts: Sequence[int]) -> float:
    """Estimated time of one decode step: compute on each shard + one round trip per hop.

    ``Device.speed`` is the effective GFLOP/s this estimate divides by.
    """
    compute_s = sum(
        layers * model.gflop_per_layer_token / max(d.speed, 1e-9)
        for d, layers in zip(devices, counts, strict=True)
    )
    hops_ms = sum(d.network_rtt_ms for d in devices[1:])
    return compute_s * 1000.0 + hops_ms


def previews(
    model: ModelSpec,
    devices: Sequence[Device],
    context_length: int = DEFAULT_CONTEXT_TOKENS,
    max_shards: int = 8,
    step: Step | None = None,
) -> list[Preview]:
    """One candidate per k = 1..max_shards: the k most capable live devices (``plan``)."""
    alive = [d for d in devices if not d.failed]
    ranked = sorted(alive, key=lambda d: (-room_gb(d) * d.speed, d.device_id))
    if not ranked:
        return [Preview(model.name, (), (), False, "no live devices", None)]
    top = min(max_shards, len(ranked), model.layers)
    return [plan(model, ranked[:k], context_length, step) for k in range(1, top + 1)]


def memory_proportional(
    model: ModelSpec, devices: Sequence[Device], context_length: int = DEFAULT_CONTEXT_TOKENS
) -> Preview:
    """exo's placement, as a baseline: the devices with the most free memory, as few as hold
    the model, with layers in proportion to memory alone (speed is not considered)."""
    ranked = sorted((d for d in devices if not d.failed), key=lambda d: (-room_gb(d), d.device_id))
    need = model.shard_gb(model.layers, True, True, context_length)
    chosen: list[Device] = []
    for device in ranked:
        chosen.append(device)
        held = sum(room_gb(d) for d in chosen)
        if held >= need and len(chosen) <= model.layers:
            break
    ids = tuple(d.device_id for d in chosen)
    limits = [
        _max_layers(model, d, i == 0, i == len(chosen) - 1, context_length)
        for i, d in enumerate(chosen)
    ]
    if not chosen or sum(limits) < model.layers:
        return Preview(model.name, ids, (), False, "memory: the fleet cannot hold it", None)
    counts = largest_remainder(model.layers, [room_gb(d) for d in chosen])
    return _preview(model, chosen, counts, context_length)


def whole_models_only(option: Preview, devices: Collection[str]) -> Preview:
    """``option``, infeasible when it cuts the model and gives a shard to one of ``devices``
    (they serve whole models only: an engine such as vLLM that runs no layer ranges)."""
    if not option.feasible or len(option.shards) <= 1:
        return option
    named = [d for d in option.devices if d in devices]
    if not named:
        return option
    reason = f"engine: {', '.join(named)} serve whole models only"
    return replace(option, feasible=False, reason=reason, shards=(), step_ms=None)


def choose(options: Sequence[Preview]) -> Preview:
    """The feasible option with the smallest step time (fewest devices on a tie), else the
    first option with its reason."""
    feasible = [o for o in options if o.feasible]
    if not feasible:
        return options[0] if options else Preview("", (), (), False, "no options", None)
    return min(feasible, key=lambda o: (o.step_ms or 0.0, len(o.devices)))
