"""Deployments, their replicas, their phases and their re-plans: the part of the scheduler
that keeps models placed as the workers report them, and routes each request to a copy that
serves.

A deploy is a *plan*: its shard tasks go out and the deployment is ``pending``. The workers'
``ShardStatus`` reports move it (``phases.py``): ``loading`` with progress, ``serving`` once
every shard of the current epoch is loaded — requests are routed to serving copies only
(``routing.py``). A
shard refused or failed by its worker, a worker silent while its shard is not loaded
(``silence_bound``), or a device the scorer declares failed: the deployment is re-planned
under a new epoch without that device (a refusing or failing device is left out of its later
plans too, its reason kept); with no placement left it stops, ``refused`` or ``failed``, with the
reasons. Every change of phase or progress is published on ``DEPLOYMENT_STATUS``.

``Deployer`` is handed what it needs by the ``Scheduler`` (service.py) that owns it, and is
only called from the scheduler's command loop (``loop.py``). Planning (candidates, the plan's
shard tasks, statuses) is its base, ``Planner`` (planning.py); what follows a plan is here.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

from libs.contracts import SHARD_TASK, DeploymentState, ShardProgress, ShardStatus, ShardTask
from libs.core.partition import Preview, choose
from services.scheduler import phases
from services.scheduler.planning import Planner
from services.scheduler.tasks import assignments_of

#: The shortest silence of a loading worker taken as its end: workers report every second.
MIN_SILENCE_S = 2.0
log = logging.getLogger(__name__)


class Deployer(Planner):
    # -- what workers report ------------------------------------------------------------------
    async def on_status(self, status: ShardStatus, now: float) -> None:
        """Apply a worker's report: progress is published, a refusal or failure re-plans."""
        deployment = self.state.deployments.get(status.deployment_id)
        if deployment is not None and status.epoch < deployment.epoch:
            await self._unload_stale(deployment, status, now)
        if deployment is None or status.epoch != deployment.epoch:
            return  # another epoch's (or a removed deployment's) news: stale
        key = (deployment.deployment_id, status.shard_index)
        if key in self.heard:
            self.heard[key] = now
        updated = phases.report(deployment, status)
        if updated is None:
            return
        self.state.deployments[updated.deployment_id] = updated
        bad = phases.troubled(updated)
        if bad:
            await self.replan_troubled(updated, bad, now)
            return
        if updated.phase != deployment.phase:
            log.info(
                "deployment phase",
                extra={"deployment_id": updated.deployment_id, "phase": updated.phase},
            )
            self.persist()
        await self.publish(updated, now)

    async def _unload_stale(
        self, deployment: DeploymentState, status: ShardStatus, now: float
    ) -> None:
        """A worker loading or serving an epoch that was re-planned (its load came back after
        a restart, say): tell it, once, to drop that epoch. A newer plan on the same device
        is not touched (a worker unloads only what is not newer than the unload)."""
        key = (status.deployment_id, status.device_id, status.epoch)
        if status.state not in ("loading", "loaded") or key in self.told_stale:
            return
        self.told_stale.add(key)
        task = ShardTask(  # an unload names only the shard: its layers are not read
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
        log.info(
            "stale shard unloaded", extra={"device_id": status.device_id, "epoch": status.epoch}
        )
        await self.bus.publish_durable(SHARD_TASK, task, device_id=status.device_id)

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

    async def check_silence(self, now: float) -> None:
        """Re-plan deployments whose workers went silent while their shards load (the device
        is left out of that plan only: its worker may come back)."""
        for deployment in list(self.state.deployments.values()):
            if deployment.phase in phases.FINAL:
                continue
            bad = phases.troubled(deployment)
            if bad:  # a refusal whose re-plan did not go out (the bus was down): again
                await self.replan_troubled(deployment, bad, now)
                continue
            if deployment.phase not in ("pending", "loading"):
                continue
            silent = {
                s.device_id: self.silence_bound(s.device_id)
                for s in deployment.shards
                if s.state in ("pending", "loading")
                and now - self.heard.get((deployment.deployment_id, s.shard_index), now)
                > self.silence_bound(s.device_id)
            }
            if silent:
                said = ", ".join(f"{d} for {b:g} s" for d, b in sorted(silent.items()))
                reason = f"no report while loading from {said}"
                await self.replan(deployment, set(silent), reason, "failed", now, remember=False)

    async def replan_troubled(
        self, deployment: DeploymentState, bad: list[ShardProgress], now: float
    ) -> None:
        """Re-plan without the devices whose shards were refused or failed."""
        final: Literal["refused", "failed"] = (
            "refused" if all(s.state == "refused" for s in bad) else "failed"
        )
        reasons = "; ".join(f"{s.device_id} {s.state}: {s.reason or 'no reason'}" for s in bad)
        await self.replan(deployment, {s.device_id for s in bad}, reasons, final, now)

    async def replan(
        self,
        deployment: DeploymentState,
        leave_out: set[str],
        reason: str,
        final: Literal["refused", "failed"],
        now: float,
        *,
        remember: bool = True,
    ) -> None:
        """Plan ``deployment`` again without ``leave_out`` (``remember``: nor in its later
        plans) under a new epoch; with no placement left it ends ``final`` with ``reason``."""
        refused_by = tuple(sorted(set(deployment.refused_by) | (leave_out if remember else set())))
        without = set(refused_by) | leave_out
        taken = {
            a.device_id
            for d in self.group(deployment.replica_of or deployment.deployment_id)
            if d.deployment_id != deployment.deployment_id and d.phase not in phases.FINAL
            for a in d.assignments
        }
        kept = functools.partial(
            self.preview,
            deployment.model,
            deployment.context_length,
            deployment.max_shards,
            now,
            precision=deployment.precision,
            moving=deployment.deployment_id,
            shard_count=deployment.shard_count,
            told=deployment.devices,
        )
        if deployment.model not in self.cards:  # removed from the registry since
            chosen = Preview(deployment.model, (), (), False, "model no longer registered", None)
        else:
            chosen = choose(kept(without=without | taken))
            if not chosen.feasible and taken:  # no room apart from the other copies: share
                chosen = choose(kept(without=without))
        # Every device of the old plan drops it (a leaving device learns its work has moved;
        # a dead one finds the unload if it comes back).
        await self._shard_tasks(deployment, "unload", now)
        if not chosen.feasible:
            ended = deployment.model_copy(
                update={
                    "phase": final,
                    "refused_by": refused_by,
                    "reason": f"{reason}; no placement left: {chosen.reason or 'infeasible'}",
                }
            )
            self.state.deployments[ended.deployment_id] = ended
            log.error(
                "deployment stopped",
                extra={
                    "deployment_id": ended.deployment_id,
                    "phase": final,
                    "reason": ended.reason,
                },
            )
            await self.publish(ended, now)
            self.persist()
            return
        new = deployment.model_copy(
            update={
                "assignments": assignments_of(chosen),
                "epoch": deployment.epoch + 1,
                "refused_by": refused_by,
                "reason": reason,
            }
        )
        new = await self._send_plan(new, now)
        self.state.counters["migrations"] += 1
        self.metrics.migrations.inc()
        log.warning(
            "deployment re-planned",
            extra={
                "deployment_id": new.deployment_id,
                "reason": reason,
                "devices": [a.device_id for a in new.assignments],
                "epoch": new.epoch,
            },
        )
        await self.announce(self.decision(new, now))
        self.persist()  # a restart must not bring back the placement before the move

    async def migrate(self, device_id: str, now: float) -> None:
        """Re-plan every live deployment with a shard on a failed device (the device is left
        out of this plan only: it may recover)."""
        for deployment in list(self.state.deployments.values()):
            if deployment.phase in phases.FINAL:
                continue
            if device_id not in {a.device_id for a in deployment.assignments}:
                continue
            reason = f"device {device_id} failed"
            await self.replan(deployment, {device_id}, reason, "failed", now, remember=False)

    def restored(self, now: float) -> None:
        """After a restart: shards still loading are heard of from now on."""
        for deployment in self.state.deployments.values():
            if deployment.phase in ("pending", "loading"):
                for shard in deployment.shards:
                    self.heard[(deployment.deployment_id, shard.shard_index)] = now

    async def resend(self, now: float, epochs: dict[str, int] | None = None) -> None:
        """After a restart: the load tasks of every live plan go out again, so workers
        report (reports sent while no scheduler led were lost; a worker that serves the
        shard answers ``loaded`` again, one that dropped it since the checkpoint loads it);
        with ``epochs``, only those of deployments still at the epoch it gives."""
        for deployment in list(self.state.deployments.values()):
            if deployment.phase in phases.FINAL:
                continue
            if epochs is None or epochs.get(deployment.deployment_id) == deployment.epoch:
                await self._shard_tasks(deployment, "load", now)
