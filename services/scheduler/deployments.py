"""Deployments, their replicas and migration: the part of the scheduler that keeps models
placed and routes each request to a replica.

``Deployments`` is handed what it needs by the ``Scheduler`` (service.py) that owns it: the
cluster view, the bus for the shard tasks, metrics, the clock, and three of the scheduler's own
steps (the devices of a cycle, saving a checkpoint, announcing a decision).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import numpy as np

from libs.contracts import (
    SHARD_TASK,
    DeploymentState,
    InferenceRequest,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    shard_ring,
)
from libs.core.catalogue import CATALOGUE, ModelSpec, as_gguf, in_precision
from libs.core.migration import replan_deployment
from libs.core.model import Device
from libs.core.partition import Preview, choose, previews, whole_models_only
from libs.core.policy import Policy
from libs.runtime.bus import Bus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.replicas import SLOTS, Running, choose_replica, replica_device
from services.scheduler.state import SchedulerState, replace_assignments
from services.scheduler.tasks import assignments_of
from services.scheduler.view import ClusterView

#: Worker engines that run a layer range of a model (vLLM runs whole models only).
SPLITTING_ENGINES = {"torch", "llamacpp"}
log = logging.getLogger(__name__)


def model_spec(model: str, precision: str | None, family: str) -> ModelSpec:
    """``model`` as the engines of ``family`` hold it: llama.cpp's workers its GGUF (weights in
    the file's types, an f16 KV cache per request slot); the torch ring in ``precision``."""
    if family == "llamacpp":
        return as_gguf(CATALOGUE[model], SLOTS["llamacpp"])
    return in_precision(CATALOGUE[model], precision)


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
        policy: Callable[[], Policy],
        rng: np.random.Generator,
    ) -> None:
        #: The scheduler's state; the scheduler sets it again when it restores a checkpoint.
        self.state = state
        self.view, self.bus, self.metrics, self.clock = view, bus, metrics, clock
        self.devices, self.save, self.announce = devices, save, announce
        #: The scheduler's active policy (it changes with ``PUT /policy`` and the mode).
        self.policy, self.rng = policy, rng
        #: Requests routed to replicas, until they are expected to end.
        self.running: list[Running] = []

    # -- deployments --------------------------------------------------------------------------
    def preview(
        self,
        model: str,
        context_length: int,
        max_shards: int,
        now: float,
        without: set[str] | frozenset[str] = frozenset(),
        precision: str | None = None,
    ) -> list[Preview]:
        """Candidate placements of ``model`` (on devices other than ``without``), its layers
        counted as each engine family holds them (``model_spec``: the torch ring in
        ``precision``)."""
        devices = [d for d in self.model_devices(now) if d.device_id not in without]
        families: dict[str, list[Device]] = {}
        for device in devices:  # a split runs on one engine: llama.cpp's, or the torch ring
            families.setdefault(self.family(device.device_id), []).append(device)
        options = [
            option
            for family, group in (families or {"ring": []}).items()
            for option in previews(
                model_spec(model, precision, family), group, context_length, max_shards
            )
        ]
        whole_only = {
            d
            for d, a in self.view.announces.items()
            if a.engines and not SPLITTING_ENGINES & set(a.engines)
        }
        return [whole_models_only(o, whole_only) for o in options]

    def family(self, device_id: str) -> str:
        """Which devices a split may combine: llamacpp workers with each other (llama.cpp's
        RPC backend), every other engine with the rest (the torch ring over NATS)."""
        announce = self.view.announces.get(device_id)
        return "llamacpp" if announce is not None and "llamacpp" in announce.engines else "ring"

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
        """Place a model (and its replicas, each on devices of its own where the fleet has
        room); the decision is the first replica's."""
        task = request.task
        assert isinstance(task, ModelDeployment)
        existing = self.state.deployments.get(task.deployment_id)
        if existing is not None:  # idempotent: a repeated request gets the live placement
            return self.decision(existing, now)
        if task.model not in CATALOGUE:
            return self.refusal(
                task.deployment_id,
                f"unknown model {task.model!r}; known: {', '.join(sorted(CATALOGUE))}",
                now,
            )
        first: DeploymentState | None = None
        for k in range(1, task.replicas + 1):
            replica_id = task.deployment_id if k == 1 else f"{task.deployment_id}-r{k}"
            taken = {a.device_id for d in self.group(task.deployment_id) for a in d.assignments}
            size = (task.model, task.context_length, task.max_shards, now)
            chosen = choose(self.preview(*size, without=taken, precision=task.precision))
            if not chosen.feasible and taken:  # no room apart: share devices
                chosen = choose(self.preview(*size, precision=task.precision))
            if not chosen.feasible:
                if first is None:
                    return self.refusal(task.deployment_id, chosen.reason or "infeasible", now)
                log.warning(
                    "replica not placed",
                    extra={"deployment_id": replica_id, "reason": chosen.reason},
                )
                break
            deployment = DeploymentState(
                deployment_id=replica_id,
                model=task.model,
                epoch=1,
                context_length=task.context_length,
                assignments=assignments_of(chosen),
                replica_of=None if k == 1 else task.deployment_id,
                precision=task.precision,
            )
            self.state.deployments[replica_id] = deployment
            first = first or deployment
            await self._shard_tasks(deployment, "load", now)
            log.info(
                "deployed",
                extra={
                    "deployment_id": replica_id,
                    "model": task.model,
                    "devices": [a.device_id for a in deployment.assignments],
                },
            )
            if k > 1:
                await self.announce(self.decision(deployment, now))
        await self.save()
        assert first is not None
        return self.decision(first, now)

    def refusal(self, deployment_id: str, reason: str, now: float) -> PlacementDecision:
        return PlacementDecision(
            task_id=deployment_id,
            kind="deployment",
            placed=False,
            reason=reason,
            policy="partition",
            mode=self.state.mode,
            ts=now,
        )

    def group(self, deployment_id: str) -> list[DeploymentState]:
        """A deployment and its replicas."""
        return [
            d
            for d in self.state.deployments.values()
            if deployment_id in (d.deployment_id, d.replica_of)
        ]

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
        self, request: PlacementRequest, deployment: DeploymentState, now: float
    ) -> PlacementDecision:
        """An inference request for a deployed model goes to the replica the active policy
        chooses on live state (``replicas.py``), or where the only one runs now."""
        task = request.task
        assert isinstance(task, InferenceRequest)
        base = deployment.replica_of or deployment.deployment_id
        group = self.group(base)
        self.running = [r for r in self.running if r.until > now]
        held = {a.device_id for d in group for a in d.assignments}
        # Only the copies' devices: their speed and state (load and memory do not count here).
        devices = {d.device_id: d for d in self.view.devices({}, {}, only=held)}
        candidates = []
        for replica in group:
            engines = self.engines_of(replica)
            device = replica_device(replica, devices, engines, self.running, now)
            if device is not None:
                candidates.append(device)
        chosen = choose_replica(self.policy(), candidates, request, now, self.rng)
        if chosen is None:
            failed = sorted(held & self.view.failed)
            return PlacementDecision(
                task_id=task.request_id,
                kind="inference",
                placed=False,
                reason=f"no_capacity: {base} waits on failed {failed}",
                policy="route",
                mode=self.state.mode,
                epoch=deployment.epoch,
                ts=now,
            )
        replica_id, seconds = chosen
        self.running.append(Running(replica_id, now + seconds))
        decision = self.decision(self.state.deployments[replica_id], now)
        return decision.model_copy(
            update={
                "task_id": task.request_id,
                "kind": "inference",
                "deployment_id": replica_id,
                "policy": self.state.policy,
            }
        )

    def engines_of(self, deployment: DeploymentState) -> tuple[str, ...]:
        engines: tuple[str, ...] = ()
        for a in deployment.assignments:
            announce = self.view.announces.get(a.device_id)
            engines += announce.engines if announce else ()
        return engines

    async def undeploy(self, deployment_id: str) -> bool:
        """Remove a deployment and its replicas (one replica alone: just that one)."""
        if deployment_id not in self.state.deployments:
            return False
        for deployment in self.group(deployment_id):
            del self.state.deployments[deployment.deployment_id]
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
        announces = [self.view.announces.get(a.device_id) for a in shards]
        endpoints = [a.rpc_endpoint if a else None for a in announces]
        ring = shard_ring(
            action,
            deployment.deployment_id,
            deployment.model,
            [(a.device_id, a.layer_start, a.layer_end) for a in shards],
            deployment.epoch,
            now,
            deployment.precision,
            [e for e in endpoints if e] if all(endpoints) else (),
            deployment.context_length,
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
            family = self.family(device_id)
            devices = [
                d
                for d in self.model_devices(now, moving=deployment.deployment_id)
                if self.family(d.device_id) == family
            ]
            live = sum(not d.failed for d in devices)
            chosen = replan_deployment(
                model_spec(deployment.model, deployment.precision, family),
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
            # Every device of the old plan drops its shards (a leaving device learns so that
            # its work has moved; a dead one finds the unload if it comes back); every device
            # of the new plan loads.
            await self._shard_tasks(old, "unload", now)
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
