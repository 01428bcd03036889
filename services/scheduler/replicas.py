"""Which replica of a deployed model serves a request: the active policy, on live state.

Each replica is one device to the core: its decode rate is the tokens/s one stream gets
through its shards (the partitioner's step time on the devices it holds), its backlog the
seconds its running requests still need, its other figures (its speed in GFLOP/s among them)
those of its first device. The active policy
(DWPS: earliest expected completion first, then fit) picks one when the placement request
arrives — the gateway asks once per request already, so no round trip is added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from libs.contracts import DeploymentState, PlacementRequest
from libs.core.catalogue import ModelSpec
from libs.core.fleet_state import FleetState
from libs.core.model import Device, TaskKind
from libs.core.partition import step_ms
from libs.core.policy import Policy
from services.scheduler.tasks import to_task

#: Requests a worker engine runs at once when its worker announces none
#: (``DeviceAnnounce.slots``): vLLM and llama.cpp's server batch; the torch shard engine's
#: requests are counted as sharing its speed.
ENGINE_SLOTS = {"vllm": 8, "llamacpp": 8, "torch": 1}


@dataclass(frozen=True)
class Running:
    """A request routed to a replica, until it is expected to end."""

    replica: str
    until: float


def replica_device(
    deployment: DeploymentState,
    devices: Mapping[str, Device],
    slots: int,
    running: Sequence[Running],
    now: float,
    spec: ModelSpec | None = None,
) -> Device | None:
    """The replica as one device running ``slots`` requests at once, or None when one of its
    devices is unknown or failed."""
    shards = sorted(deployment.assignments, key=lambda a: a.shard_index)
    held = [devices.get(a.device_id) for a in shards]
    if any(d is None or d.failed for d in held):
        return None
    chain = [d for d in held if d is not None]
    counts = [a.layer_end - a.layer_start for a in shards]
    # A model no longer registered: no rate (a request's seconds then come from its first
    # device's speed, ``work / speed``).
    tokens_per_s = 0.0 if spec is None else 1000.0 / max(step_ms(spec, chain, counts), 1e-6)
    # Each running request's expected end counts its own wait: a new one gets a slot when
    # the earliest of the last ``slots`` ends.
    left = sorted(r.until - now for r in running if r.replica == deployment.deployment_id)
    backlog = left[len(left) - slots] if len(left) >= slots else 0.0
    return dataclasses.replace(
        chain[0],
        device_id=deployment.deployment_id,
        slots=slots,
        load=len(left) / slots,
        backlog_s=backlog,
        # The request's tokens at the chain's rate (its prompt is not counted: ``choose``).
        prefill_tokens_per_s=tokens_per_s,
        decode_tokens_per_s=tokens_per_s,
    )


def choose_replica(
    policy: Policy,
    candidates: Sequence[Device],
    request: PlacementRequest,
    now: float,
    rng: np.random.Generator,
) -> tuple[str, float] | None:
    """The replica ``policy`` places ``request`` on and the seconds it should take there;
    None when no replica can serve (every one has a failed device)."""
    if not candidates:
        return None
    # Its seconds on a replica: its output tokens at the replica's decode rate.
    asked = to_task(request)
    task = dataclasses.replace(
        asked,
        memory_gb=0.0,
        kind=TaskKind.INFERENCE,
        prompt_tokens=0,
        output_tokens=int(asked.work),
    )
    fleet = FleetState(candidates)
    finish = fleet.completion_s(task)
    [placement] = policy.place(fleet, [task], now, rng)
    # A copy that a filter refuses (hot, at its power budget) still serves rather than
    # fail the request: the one that would finish first.
    i = fleet.index[placement.device_id] if placement.device_id else int(np.argmin(finish))
    return fleet.ids[i], float(finish[i])
