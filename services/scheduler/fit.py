"""The models a deploy names, as placement needs them: cards from the registry, sizes from the
cards, devices whose engine serves the model, and what a deploy told it to do.

The cards are read from Redis outside the command loop (``Scheduler.learn``) and kept here;
the loop only reads them. Every helper is pure over what it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from libs.contracts import DEFAULT_CONTEXT_TOKENS, DeviceAnnounce, ModelCard
from libs.core.catalogue import ModelSpec, card_spec
from libs.core.model import Device
from libs.core.partition import Preview, Step, plan, previews
from libs.models.engine_support import unserved_reason


def spec_for(card: ModelCard, family: str, slots: int, precision: str | None) -> ModelSpec:
    """``card``'s model as the engines of ``family`` hold it (``card_spec``)."""
    return card_spec(card, family, slots, precision)


def left_out(
    card: ModelCard,
    devices: Sequence[Device],
    announces: Mapping[str, DeviceAnnounce],
    context_length: int | None = None,
) -> dict[str, str]:
    """Devices that cannot serve ``card``'s model, each with why: every engine refuses it, or
    its worker announced a context shorter than ``context_length`` (the longest one its engine
    gives a request). A device with no announced engine (an emulated fleet planned as a whole)
    is not held to any engine, nor a worker that announced no context to a length."""
    reasons: dict[str, str] = {}
    for device in devices:
        announce = announces.get(device.device_id)
        engines = announce.engines if announce is not None else ()
        why = [r for e in engines if (r := unserved_reason(e, card))]
        if not engines or len(why) < len(engines):
            why = []
        longest = announce.context_length if announce is not None else None
        if context_length is not None and longest is not None and longest < context_length:
            why.append(
                f"its worker gives a request at most {longest:,} tokens of context, "
                f"the deployment {context_length:,}"
            )
        if why:
            reasons[device.device_id] = "; ".join(why)
    return reasons


def default_context(
    card: ModelCard, devices: Sequence[Device], announces: Mapping[str, DeviceAnnounce]
) -> int:
    """The context of a deployment of ``card``'s model that names none:
    ``DEFAULT_CONTEXT_TOKENS`` tokens, no more than the model was trained on, and no more than
    the longest context that a worker able to serve it announces (a worker that announces none,
    whose engine sizes its cache to each deployment, sets no bound), so that the longest-context
    workers can hold it and a shorter one is left out saying why."""
    able = [d for d in devices if d.device_id not in left_out(card, [d], announces)]
    bounds = [
        a.context_length if a is not None else None
        for a in (announces.get(d.device_id) for d in able)
    ]
    context = min(DEFAULT_CONTEXT_TOKENS, card.context_train or DEFAULT_CONTEXT_TOKENS)
    if bounds and None not in bounds:
        context = min(context, max(b for b in bounds if b is not None))
    return context


def why_left(reasons: Mapping[str, str]) -> str:
    return ", ".join(f"{d} ({r})" for d, r in sorted(reasons.items()))


def told_options(
    spec: ModelSpec,
    devices: Sequence[Device],
    context_length: int,
    max_shards: int,
    shard_count: int | None,
    told_devices: Sequence[str],
    without: Collection[str] = (),
    step: Step | None = None,
) -> list[Preview]:
    """The candidate placements a deploy allows: on exactly ``told_devices`` (in that order)
    when it names them, with exactly ``shard_count`` shards when it says so, else the
    scheduler's own candidates (up to ``max_shards``). A told choice that cannot be kept is
    one infeasible option whose reason says why. ``step``: the placement's estimate of a
    decode step (``partition.Step``) its splits are weighed by."""
    by_id = {d.device_id: d for d in devices}
    if told_devices:
        gone = [d for d in told_devices if d not in by_id or d in without]
        if gone:
            return [_no(spec, f"told devices not available for it: {', '.join(gone)}")]
        if shard_count is not None and shard_count != len(told_devices):
            return [_no(spec, f"told {shard_count} shards on {len(told_devices)} devices")]
        if len(told_devices) > spec.layers:
            return [_no(spec, f"{len(told_devices)} devices for {spec.layers} layers")]
        return [plan(spec, [by_id[d] for d in told_devices], context_length, step)]
    usable = [d for d in devices if d.device_id not in without]
    if shard_count is None:
        return previews(spec, usable, context_length, max_shards, step)
    candidates = previews(spec, usable, context_length, shard_count, step)
    options = [o for o in candidates if len(o.devices) == shard_count]
    if not options:
        return [_no(spec, f"told {shard_count} shards: only {len(usable)} device(s) can take one")]
    return options


def _no(spec: ModelSpec, reason: str) -> Preview:
    return Preview(spec.name, (), (), False, reason, None)


def fleet_too_small(spec: ModelSpec, devices: Sequence[Device], context_length: int) -> str | None:
    """Why no placement can hold the model, when even all the fleet's free memory is less
    than its weights and KV cache (one runtime overhead counted), the VRAM of devices whose
    engine offloads to a GPU counted too."""
    need = spec.shard_gb(spec.layers, True, True, context_length)
    live = [d for d in devices if not d.failed]
    vram = sum(d.vram_free_gb for d in live)
    free = sum(d.memory_free_gb for d in live) + vram
    if need <= free:
        return None
    gpu = f" ({vram:.2f} GB of it a GPU's)" if vram > 0 else ""
    return (
        f"{spec.name} needs {need:.2f} GB; the whole fleet has {free:.2f} GB free{gpu}: join a "
        "machine with more memory (`make join ADDR=… TOKEN=…` there, as `tessera up --listen` "
        "prints it), or deploy a smaller quantization or a shorter --context"
    )


def explain(option: Preview, reasons: Mapping[str, str]) -> Preview:
    """``option`` with the devices left out named in its reason, when it is infeasible."""
    if option.feasible or not reasons:
        return option
    return dataclasses.replace(
        option, reason=f"{option.reason or 'infeasible'}; left out: {why_left(reasons)}"
    )
