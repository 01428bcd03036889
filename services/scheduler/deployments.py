"""Deployments and migration: the part of the scheduler that keeps models placed.

``Deployments`` is handed what it needs by the ``Scheduler`` (service.py) that owns it: the
cluster view, the bus for the shard tasks, metrics, the clock, and three of the scheduler's own
steps (the devices of a cycle, saving a checkpoint, announcing a decision).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from libs.contracts import (
    SHARD_TASK,
    DeploymentState,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    shard_ring,
)
from libs.core.catalogue import CATALOGUE
from libs.core.migration import replan_deployment
from libs.core.model import Device
from libs.core.partition import Preview, choose, previews, whole_models_only
from libs.runtime.bus import Bus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import SchedulerState, replace_assignments
from services.scheduler.tasks import assignments_of
from services.scheduler.view import ClusterView

log = logging.getLogger(__name__)


class Deployments:
    def __init__(
        self,
        state: SchedulerState,
        view: ClusterView,
        bus: Bus,
        metrics: SchedulerMetrics,
        clock: Callable[[], float],
        *,
        devices: Callable[[float, str | None], list[Device]],
        save: Callable[[], Awaitable[None]],
        announce: Callable[[PlacementDecision], Awaitable[None]],
    ) -> None:
        #: The scheduler's state; the scheduler sets it again when it restores a checkpoint.
        self.state = state
        self.view, self.bus, self.metrics, self.clock = view, bus, metrics, clock
        self.devices, self.save, self.announce = devices, save, announce

    # -- deployments --------------------------------------------------------------------------
    def preview(
        self, model: str, context_length: int, max_shards: int, now: float
    ) -> list[Preview]:
        options = previews(CATALOGUE[model], self.model_devices(now), context_length, max_shards)
        whole_only = {
            d for d, a in self.view.announces.items() if a.engines and "torch" not in a.engines
        }
        return [whole_models_only(o, whole_only) for o in options]

    def model_devices(self, now: float, moving: str | None = None) -> list[Device]:
        """Devices that can hold shards: those with a worker engine, when any device has one.
        The memory of deployment ``moving`` counts as free (its shards are being replaced).

        A fleet of emulated devices without workers (the simulator, scheduling demos) is
        planned on as a whole.
        """
        devices = self.devices(now, moving)
        serving = {d for d, a in self.view.announces.items() if a.engines}
        if not serving:
            return devices
        return [d for d in devices if d.device_id in serving]

    async def deploy(self, request: PlacementRequest, now: float) -> PlacementDecision:
        task = request.task
        assert isinstance(task, ModelDeployment)
        existing = self.state.deployments.get(task.deployment_id)
        if existing is not None:  # idempotent: a repeated request gets the live placement
            return self.decision(existing, now)
        if task.model not in CATALOGUE:
            return PlacementDecision(
                task_id=task.deployment_id,
                kind="deployment",
                placed=False,
                reason=f"unknown model {task.model!r}; known: {', '.join(sorted(CATALOGUE))}",
                policy="partition",
                mode=self.state.mode,
                ts=now,
            )
        chosen = choose(self.preview(task.model, task.context_length, task.max_shards, now))
        if not chosen.feasible:
            return PlacementDecision(
                task_id=task.deployment_id,
                kind="deployment",
                placed=False,
                reason=chosen.reason or "infeasible",
                policy="partition",
                mode=self.state.mode,
                ts=now,
            )
        deployment = DeploymentState(
            deployment_id=task.deployment_id,
            model=task.model,
            epoch=1,
            context_length=task.context_length,
            assignments=assignments_of(chosen),
        )
        self.state.deployments[task.deployment_id] = deployment
        await self._shard_tasks(deployment, "load", now)
        log.info(
            "deployed",
            extra={
                "deployment_id": task.deployment_id,
                "model": task.model,
                "devices": [a.device_id for a in deployment.assignments],
            },
        )
        await self.save()
        return self.decision(deployment, now)

    def decision(self, deployment: DeploymentState, now: float) -> PlacementDecision:
        return PlacementDecision(
            task_id=deployment.deployment_id,
            kind="deployment",
            placed=True,
            assignments=deployment.assignments,
            policy="partition",
            mode=self.state.mode,
            epoch=deployment.epoch,
            ts=now,
        )

    def serving(self, model: str) -> DeploymentState | None:
        """The deployment that serves ``model`` (a deployment id, or a model's name)."""
        if model in self.state.deployments:
            return self.state.deployments[model]
        named = [d for d in self.state.deployments.values() if d.model == model]
        return min(named, key=lambda d: d.deployment_id) if named else None

    def route_decision(
        self, request_id: str, deployment: DeploymentState, now: float
    ) -> PlacementDecision:
        """An inference request for a deployed model goes where its deployment runs now."""
        failed = [a.device_id for a in deployment.assignments if a.device_id in self.view.failed]
        if failed:
            return PlacementDecision(
                task_id=request_id,
                kind="inference",
                placed=False,
                reason=f"no_capacity: {deployment.deployment_id} waits on failed {failed}",
                policy="route",
                mode=self.state.mode,
                epoch=deployment.epoch,
                ts=now,
            )
        decision = self.decision(deployment, now)
        return decision.model_copy(update={"task_id": request_id, "kind": "inference"})

    async def undeploy(self, deployment_id: str) -> bool:
        deployment = self.state.deployments.pop(deployment_id, None)
        if deployment is None:
            return False
        await self._shard_tasks(deployment, "unload", self.clock())
        await self.save()
        return True

    async def _shard_tasks(
        self,
        deployment: DeploymentState,
        action: Literal["load", "unload"],
        now: float,
        only: set[str] | None = None,
    ) -> None:
        """Durable shard tasks (JetStream) to each device of ``deployment``."""
        shards = sorted(deployment.assignments, key=lambda a: a.shard_index)
        ring = shard_ring(
            action,
            deployment.deployment_id,
            deployment.model,
            [(a.device_id, a.layer_start, a.layer_end) for a in shards],
            deployment.epoch,
            now,
        )
        for task in ring:
            if only is None or task.device_id in only:
                await self.bus.publish_durable(SHARD_TASK, task, device_id=task.device_id)

    # -- failures -----------------------------------------------------------------------------
    async def migrate(self, device_id: str, now: float) -> None:
        """Move every shard of a failed device to the best alternatives."""
        for deployment in list(self.state.deployments.values()):
            if device_id not in self.state.devices_of(deployment.deployment_id):
                continue
            devices = self.model_devices(now, moving=deployment.deployment_id)
            live = sum(not d.failed for d in devices)
            chosen = replan_deployment(
                CATALOGUE[deployment.model],
                devices,
                {device_id},
                deployment.context_length,
                max(1, live),
            )
            if not chosen.feasible:
                log.error(
                    "cannot re-place deployment",
                    extra={"deployment_id": deployment.deployment_id, "reason": chosen.reason},
                )
                continue
            old = deployment
            new = replace_assignments(old, assignments_of(chosen))
            self.state.deployments[new.deployment_id] = new
            # Live devices drop the old epoch's shards; every device of the new plan loads.
            await self._shard_tasks(
                old,
                "unload",
                now,
                only={a.device_id for a in old.assignments if a.device_id != device_id},
            )
            await self._shard_tasks(new, "load", now)
            self.state.counters["migrations"] += 1
            self.metrics.migrations.inc()
            log.warning(
                "migrated deployment",
                extra={
                    "deployment_id": new.deployment_id,
                    "failed_device": device_id,
                    "devices": [a.device_id for a in new.assignments],
                    "epoch": new.epoch,
                },
            )
            await self.announce(self.decision(new, now))
        await self.save()  # a restart must not bring back the placement before the move
