"""Deployments as commands: each takes the deployment book and returns the changes it makes.

A deploy is a *plan*: ``DeploymentPlanned`` with every shard pending. The workers' reports
(``ShardReported``) move it to ``loading`` and ``serving`` (``libs/deployments/phases.py``).
A shard refused or failed by its worker, a worker silent while its shard is not loaded
(``silence_bound``), or a device the scorer declares failed: the deployment is re-planned under
a new epoch without that device (a refusing or failing device is left out of its later plans
too, its reason kept); with no placement left it stops (``DeploymentStopped``), ``refused`` or
``failed``, with the reasons. An undeploy is ``DeploymentRemoved``.

Nothing here sends or stores anything: the scheduler (service.py) records the changes in the
book, publishes them as events and sends the shard tasks each change implies (``tasks_for``).
The one thing kept here is when each loading shard was last heard of (``heard``): time, not
state, so it is neither an event nor checkpointed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from libs.contracts import (
    DeploymentChange,
    DeploymentMeasured,
    DeploymentPlanned,
    DeploymentRemoved,
    DeploymentState,
    DeploymentStopped,
    ModelDeployment,
    ShardProgress,
    ShardReported,
    ShardStatus,
    ShardTask,
    shard_ring,
)
from libs.core.partition import Preview, choose
from libs.deployments import DeploymentBook, apply, phases
from services.scheduler import speeds
from services.scheduler.planning import Planner
from services.scheduler.tasks import assignments_of
from services.scheduler.view import ClusterView

#: The shortest silence of a loading worker taken as its end: workers report every second.
MIN_SILENCE_S = 2.0


@dataclass
class Outcome:
    """What a command changed, and about which deployment; ``refused``: why it placed
    nothing (the changes may still remove what it replaced)."""

    deployment_id: str
    changes: list[DeploymentChange] = field(default_factory=list)
    refused: str | None = None


def fold(book: DeploymentBook, changes: Iterable[DeploymentChange]) -> DeploymentBook:
    for change in changes:
        book = apply(book, change)
    return book


class Deployer:
    def __init__(self, planner: Planner, view: ClusterView, silence_s: float | None) -> None:
        self.planner, self.view = planner, view
        #: A shard not loaded whose worker said nothing for this long is taken as failed
        #: (None: ``silence_bound``, from the device's telemetry interval).
        self.silence_s = silence_s
        #: When each shard of a current plan was last heard of (its task sent, a report).
        self.heard: dict[tuple[str, int], float] = {}
        #: (deployment, device, epoch) of stale shards already told to unload.
        self.told_stale: set[tuple[str, str, int]] = set()

    # -- commands -----------------------------------------------------------------------------
    def deploy(self, book: DeploymentBook, task: ModelDeployment, now: float) -> Outcome:
        """Plan a model and its replicas, each on devices of its own where the fleet has room.
        Deploying a live deployment again changes nothing; one that stopped is replaced."""
        base = task.deployment_id
        existing = book.get(base)
        if existing is not None and existing.phase not in phases.FINAL:
            return Outcome(base)
        old = book.group(base)
        changes: list[DeploymentChange] = [
            DeploymentRemoved(deployment_id=d.deployment_id) for d in old
        ]
        # Late news of the old plan is stale: the new one starts past its epoch.
        first_epoch = max((d.epoch + 1 for d in old), default=1)
        if task.model not in self.planner.cards:
            registered = ", ".join(sorted(self.planner.cards))
            reason = (
                f"unknown model {task.model!r}; registered: {registered}"
                " (add it with `tessera models add FILE.gguf`)"
            )
            return Outcome(base, changes, reason)
        scratch = fold(book, changes)
        context = self.planner.context_for(scratch, task.model, task.context_length, now)
        for k in range(1, task.replicas + 1):
            taken = {a.device_id for d in scratch.group(base) for a in d.assignments}
            told = functools.partial(
                self.planner.preview,
                scratch,
                task.model,
                context,
                task.max_shards,
                now,
                precision=task.precision,
                shard_count=task.shard_count,
                told=task.devices,
            )
            chosen = choose(told(without=taken))
            if not chosen.feasible and taken:  # no room apart: share devices
                chosen = choose(told())
            if not chosen.feasible:
                reason = chosen.reason or "infeasible"
                if k > 1:  # told n copies: n, or none of them
                    placed = [
                        DeploymentRemoved(deployment_id=d.deployment_id)
                        for d in scratch.group(base)
                    ]
                    changes += placed
                    reason = f"replica {k} of {task.replicas} not placed: {reason}"
                return Outcome(base, changes, reason)
            deployment = DeploymentState(
                deployment_id=base if k == 1 else f"{base}-r{k}",
                model=task.model,
                epoch=first_epoch,
                context_length=context,
                assignments=assignments_of(chosen),
                replica_of=None if k == 1 else base,
                precision=task.precision,
                max_shards=task.max_shards,
                shard_count=task.shard_count,
                devices=task.devices,
                predicted=speeds.predicted(self.planner, scratch, chosen, task.precision, now),
            )
            planned = DeploymentPlanned(
                deployment=phases.planned(deployment, self.planner.no_worker())
            )
            changes.append(planned)
            scratch = apply(scratch, planned)
        return Outcome(base, changes)

    def report(
        self, book: DeploymentBook, status: ShardStatus, now: float
    ) -> list[DeploymentChange]:
        """A worker's report on its shard: the shard's progress; a refusal or failure re-plans."""
        deployment = book.get(status.deployment_id)
        if deployment is None or status.epoch != deployment.epoch:
            return []  # another epoch's (or a removed deployment's) news: stale
        key = (deployment.deployment_id, status.shard_index)
        if key in self.heard:
            self.heard[key] = now
        shard = phases.shard_of(status)
        updated = phases.report(deployment, status.epoch, shard)
        if updated is None:
            return []
        reported = ShardReported(
            deployment_id=status.deployment_id, epoch=status.epoch, shard=shard
        )
        bad = phases.troubled(updated)
        if not bad:
            return [reported]
        return [reported, *self._replan_troubled(apply(book, reported), updated, bad, now)]

    def check_silence(self, book: DeploymentBook, now: float) -> list[DeploymentChange]:
        """Re-plan deployments whose workers went silent while their shards load (the device
        is left out of that plan only: its worker may come back), and those whose refusal
        was not re-planned yet."""
        changes: list[DeploymentChange] = []
        for deployment in book.live():
            current = fold(book, changes).get(deployment.deployment_id)
            if current is None or current.phase in phases.FINAL:
                continue
            bad = phases.troubled(current)
            if bad:  # a refusal whose re-plan did not go out (the bus was down): again
                changes += self._replan_troubled(fold(book, changes), current, bad, now)
                continue
            if current.phase not in ("pending", "loading"):
                continue
            silent = {
                s.device_id: self.silence_bound(s.device_id)
                for s in current.shards
                if s.state in ("pending", "loading")
                and now - self.heard.get((current.deployment_id, s.shard_index), now)
                > self.silence_bound(s.device_id)
            }
            if silent:
                said = ", ".join(f"{d} for {b:g} s" for d, b in sorted(silent.items()))
                changes += self.replan(
                    fold(book, changes),
                    current,
                    set(silent),
                    f"no report while loading from {said}",
                    "failed",
                    now,
                    remember=False,
                )
        return changes

    def migrate(self, book: DeploymentBook, device_id: str, now: float) -> list[DeploymentChange]:
        """Re-plan every live deployment with a shard on a failed device (the device is left
        out of this plan only: it may recover)."""
        changes: list[DeploymentChange] = []
        for deployment in book.live():
            if device_id not in deployment.route:
                continue
            reason = f"device {device_id} failed"
            current = fold(book, changes)
            changes += self.replan(
                current, deployment, {device_id}, reason, "failed", now, remember=False
            )
        return changes

    def undeploy(self, book: DeploymentBook, deployment_id: str) -> list[DeploymentChange] | None:
        """Remove a deployment and its replicas (one replica alone: just that one); None when
        there is no such deployment."""
        if deployment_id not in book:
            return None
        return [DeploymentRemoved(deployment_id=d.deployment_id) for d in book.group(deployment_id)]

    def replan(
        self,
        book: DeploymentBook,
        deployment: DeploymentState,
        leave_out: set[str],
        reason: str,
        final: Literal["refused", "failed"],
        now: float,
        *,
        remember: bool = True,
    ) -> list[DeploymentChange]:
        """Plan ``deployment`` again without ``leave_out`` (``remember``: nor in its later
        plans) under a new epoch; with no placement left it stops ``final`` with ``reason``."""
        refused_by = tuple(sorted(set(deployment.refused_by) | (leave_out if remember else set())))
        without = set(refused_by) | leave_out
        taken = {
            a.device_id
            for d in book.group(deployment.base)
            if d.deployment_id != deployment.deployment_id and d.phase not in phases.FINAL
            for a in d.assignments
        }
        kept = functools.partial(
            self.planner.preview,
            book,
            deployment.model,
            deployment.context_length,
            deployment.max_shards,
            now,
            precision=deployment.precision,
            moving=deployment.deployment_id,
            shard_count=deployment.shard_count,
            told=deployment.devices,
        )
        if deployment.model not in self.planner.cards:  # removed from the registry since
            chosen = Preview(deployment.model, (), (), False, "model no longer registered", None)
        else:
            chosen = choose(kept(without=without | taken))
            if not chosen.feasible and taken:  # no room apart from the other copies: share
                chosen = choose(kept(without=without))
        if not chosen.feasible:
            why = f"{reason}; no placement left: {chosen.reason or 'infeasible'}"
            stopped = DeploymentStopped(
                deployment_id=deployment.deployment_id,
                phase=final,
                reason=why[:2000],
                refused_by=refused_by,
            )
            return [stopped]
        new = deployment.model_copy(
            update={
                "assignments": assignments_of(chosen),
                "epoch": deployment.epoch + 1,
                "refused_by": refused_by,
                "reason": reason,
                "predicted": speeds.predicted(
                    self.planner, book, chosen, deployment.precision, now, deployment
                ),
                "measured": None,  # the new plan's requests measure it again
            }
        )
        return [DeploymentPlanned(deployment=phases.planned(new, self.planner.no_worker()))]

    def _replan_troubled(
        self,
        book: DeploymentBook,
        deployment: DeploymentState,
        bad: list[ShardProgress],
        now: float,
    ) -> list[DeploymentChange]:
        """Re-plan without the devices whose shards were refused or failed."""
        final: Literal["refused", "failed"] = (
            "refused" if all(s.state == "refused" for s in bad) else "failed"
        )
        reasons = "; ".join(f"{s.device_id} {s.state}: {s.reason or 'no reason'}" for s in bad)
        return self.replan(book, deployment, {s.device_id for s in bad}, reasons, final, now)

    # -- time ---------------------------------------------------------------------------------
    def silence_bound(self, device_id: str) -> float:
        """How long a worker may say nothing while its shard loads: ``silence_s`` where set,
        else three of its device's telemetry intervals (what the scorer's failure detector
        allows its telemetry), and never under ``MIN_SILENCE_S`` (workers report every
        second while loading)."""
        if self.silence_s is not None:
            return self.silence_s
        announce = self.view.announces.get(device_id)
        interval = announce.interval_s if announce is not None else 5.0
        return max(MIN_SILENCE_S, 3 * interval)

    def heard_plan(self, deployment: DeploymentState, now: float) -> None:
        """A plan's tasks went out: each of its shards is heard of from ``now``."""
        for key in [k for k in self.heard if k[0] == deployment.deployment_id]:
            del self.heard[key]
        for shard in deployment.shards:
            self.heard[(deployment.deployment_id, shard.shard_index)] = now

    def restored(self, book: DeploymentBook, now: float) -> None:
        """After a restart: shards still loading are heard of from now on."""
        for deployment in book.live():
            if deployment.phase in ("pending", "loading"):
                self.heard_plan(deployment, now)

    # -- what the changes send ----------------------------------------------------------------
    def tasks_for(
        self, before: DeploymentBook, change: DeploymentChange, now: float
    ) -> list[list[ShardTask]]:
        """The shard tasks a change sends, in batches to send one after the other: a plan that
        replaces a live one unloads the old plan first (every device of it: a leaving device
        learns its work has moved, a dead one finds the unload if it comes back); a stop or a
        removal unloads a live plan."""
        if isinstance(change, ShardReported | DeploymentMeasured):
            return []
        old = before.get(
            change.deployment.deployment_id
            if isinstance(change, DeploymentPlanned)
            else change.deployment_id
        )
        batches = []
        if old is not None and old.phase not in phases.FINAL:
            batches.append(self.shard_tasks(old, "unload", now))
        if isinstance(change, DeploymentPlanned):
            batches.append(self.shard_tasks(change.deployment, "load", now))
        return batches

    def shard_tasks(
        self, deployment: DeploymentState, action: Literal["load", "unload"], now: float
    ) -> list[ShardTask]:
        """One task per shard of ``deployment``'s plan."""
        shards = sorted(deployment.assignments, key=lambda a: a.shard_index)
        announces = [self.view.announces.get(a.device_id) for a in shards]
        endpoints = [a.rpc_endpoint if a else None for a in announces]
        return shard_ring(
            action,
            deployment.deployment_id,
            deployment.model,
            [(a.device_id, a.layer_start, a.layer_end) for a in shards],
            deployment.epoch,
            now,
            deployment.precision,
            [e for e in endpoints if e] if all(endpoints) else (),
            deployment.context_length,
            self.planner.cards.get(deployment.model),
            [
                a.gpu_layers if n is not None and n.vram_gb else None
                for a, n in zip(shards, announces, strict=True)
            ],
            [a.memory_gb for a in shards],
        )

    def stale_unload(
        self, book: DeploymentBook, status: ShardStatus, now: float
    ) -> ShardTask | None:
        """A worker loading or serving an epoch that was re-planned (its load came back after
        a restart, say): tell it, once, to drop that epoch. A newer plan on the same device
        is not touched (a worker unloads only what is not newer than the unload)."""
        deployment = book.get(status.deployment_id)
        if deployment is None or status.epoch >= deployment.epoch:
            return None
        key = (status.deployment_id, status.device_id, status.epoch)
        if status.state not in ("loading", "loaded") or key in self.told_stale:
            return None
        self.told_stale.add(key)
        return ShardTask(  # an unload names only the shard: its layers are not read
            action="unload",
            deployment_id=deployment.deployment_id,
            model=deployment.model,
            device_id=status.device_id,
            shard_index=status.shard_index,
            shard_count=status.shard_index + 1,
            layer_start=0,
            layer_end=1,
            epoch=status.epoch,
            ts=now,
        )
