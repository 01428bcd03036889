"""A deployment's phase, driven by what its workers report. Pure: no I/O.

A plan starts ``pending``: one ``ShardProgress`` per shard, each ``pending`` until its worker
answers. Reports of the current epoch move the shards (loading with progress, loaded, refused,
failed); the deployment is ``loading`` once any worker has answered and ``serving`` only when
every shard of the epoch is loaded. A shard on a device without a worker engine (an emulated
fleet planned for scheduling only) has nothing to load: it counts as loaded at once.
"""

from __future__ import annotations

from collections.abc import Collection

from libs.contracts import (
    DeploymentPhase,
    DeploymentState,
    DeploymentStatus,
    ShardProgress,
    ShardStatus,
)

#: Phases a deployment leaves only when the user deploys it again.
FINAL = frozenset({"refused", "failed"})


def planned(deployment: DeploymentState, no_worker: Collection[str]) -> DeploymentState:
    """``deployment`` as just sent to its workers: every shard pending (loaded where its
    device has no worker), the phase following from them."""
    shards = tuple(
        ShardProgress(
            device_id=a.device_id,
            shard_index=a.shard_index,
            state="loaded" if a.device_id in no_worker else "pending",
            progress=1.0 if a.device_id in no_worker else 0.0,
        )
        for a in sorted(deployment.assignments, key=lambda a: a.shard_index)
    )
    return deployment.model_copy(update={"shards": shards, "phase": phase_of(shards)})


def phase_of(shards: tuple[ShardProgress, ...]) -> DeploymentPhase:
    """``serving`` when every shard is loaded, ``pending`` while none has answered, else
    ``loading`` (refusals and failures are the caller's to act on)."""
    if shards and all(s.state == "loaded" for s in shards):
        return "serving"
    if all(s.state == "pending" for s in shards):
        return "pending"
    return "loading"


def progress(deployment: DeploymentState) -> float:
    """Share of the current plan loaded: the mean of its shards' progress."""
    if not deployment.shards:
        return 1.0 if deployment.phase == "serving" else 0.0
    return sum(s.progress for s in deployment.shards) / len(deployment.shards)


def shard_of(status: ShardStatus) -> ShardProgress:
    """A worker's report as the shard's progress (a loaded shard is whole)."""
    done = status.state == "loaded"
    return ShardProgress(
        device_id=status.device_id,
        shard_index=status.shard_index,
        state=status.state,
        progress=1.0 if done else (status.progress or 0.0),
        reason=status.reason,
    )


def report(deployment: DeploymentState, epoch: int, shard: ShardProgress) -> DeploymentState | None:
    """``deployment`` after a worker's report on ``shard`` of ``epoch``; None when it does not
    apply (another epoch, a shard or device it does not have, an unload, a final phase, or
    nothing new)."""
    if epoch != deployment.epoch or deployment.phase in FINAL or shard.state == "unloaded":
        return None
    found = [
        i
        for i, s in enumerate(deployment.shards)
        if s.shard_index == shard.shard_index and s.device_id == shard.device_id
    ]
    if not found or deployment.shards[found[0]] == shard:
        return None
    [i] = found
    shards = (*deployment.shards[:i], shard, *deployment.shards[i + 1 :])
    phase = deployment.phase
    if phase in ("pending", "loading", "serving"):
        phase = phase_of(shards)
    return deployment.model_copy(update={"shards": shards, "phase": phase})


def troubled(deployment: DeploymentState) -> list[ShardProgress]:
    """The current plan's shards whose workers refused or failed them."""
    return [s for s in deployment.shards if s.state in ("refused", "failed")]


def status_of(deployment: DeploymentState, now: float) -> DeploymentStatus:
    return DeploymentStatus(
        deployment_id=deployment.deployment_id,
        model=deployment.model,
        phase=deployment.phase,
        epoch=deployment.epoch,
        progress=progress(deployment),
        reason=deployment.reason,
        shards=deployment.shards,
        replica_of=deployment.replica_of,
        context_length=deployment.context_length,
        ts=now,
    )
