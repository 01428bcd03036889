"""Planning deployments: where a model's shards go (the candidates each engine family allows,
the devices left out and why, the context a deployment gets), sending a plan's shard tasks and
publishing each deployment's status. ``Deployer`` (deployments.py) adds what follows a plan:
the workers' reports, re-plans and moves.

Only called from the scheduler's command loop (``loop.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Literal

from libs.contracts import (
    DEPLOYMENT_STATUS,
    SHARD_TASK,
    DeploymentState,
    ModelCard,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    shard_ring,
)
from libs.core.catalogue import ModelSpec
from libs.core.model import Device
from libs.core.partition import Preview, choose, whole_models_only
from libs.runtime.bus import Bus
from services.scheduler import models, phases
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.replicas import ENGINE_SLOTS
from services.scheduler.state import SchedulerState
from services.scheduler.tasks import assignments_of
from services.scheduler.view import ClusterView

#: Worker engines that run a layer range of a model (vLLM runs whole models only).
SPLITTING_ENGINES = {"torch", "llamacpp"}
log = logging.getLogger(__name__)


class Planner:
    def __init__(
        self,
        state: SchedulerState,
        view: ClusterView,
        bus: Bus,
        metrics: SchedulerMetrics,
        clock: Callable[[], float],
        *,
        devices: Callable[[float, str | None], list[Device]],
        persist: Callable[[], None],
        announce: Callable[[PlacementDecision], Awaitable[None]],
        silence_s: float | None,
    ) -> None:
        #: The scheduler's state; the scheduler sets it again when it restores a checkpoint.
        self.state = state
        self.view, self.bus, self.metrics, self.clock = view, bus, metrics, clock
        self.devices, self.persist, self.announce = devices, persist, announce
        #: A shard not loaded whose worker said nothing for this long is taken as failed
        #: (None: ``silence_bound``, from the device's telemetry interval).
        self.silence_s = silence_s
        #: When each shard of a current plan was last heard of (its task sent, a report).
        self.heard: dict[tuple[str, int], float] = {}
        #: (deployment, device, epoch) of stale shards already told to unload.
        self.told_stale: set[tuple[str, str, int]] = set()
        #: The registered models' cards, as last read from the registry (``Scheduler.learn``).
        self.cards: dict[str, ModelCard] = {}

    def spec_of(
        self, model: str, precision: str | None = None, family: str = "ring"
    ) -> ModelSpec | None:
        """``model`` as the engines of ``family`` hold it (None: not registered)."""
        card = self.cards.get(model)
        if card is None:
            return None
        return models.spec_for(card, family, ENGINE_SLOTS.get(family, 1), precision)

    # -- planning -----------------------------------------------------------------------------
    def preview(
        self,
        model: str,
        context_length: int,
        max_shards: int,
        now: float,
        without: Collection[str] = frozenset(),
        precision: str | None = None,
        moving: str | None = None,
        shard_count: int | None = None,
        told: tuple[str, ...] = (),
    ) -> list[Preview]:
        """Candidate placements of registered ``model`` (on devices other than ``without``
        whose engine serves it; the memory of deployment ``moving`` counted free), its layers
        counted as each engine family holds them (``card_spec``: the torch ring in
        ``precision``); ``shard_count`` and ``told`` devices: exactly those. An infeasible
        option names the devices left out and why."""
        card = self.cards[model]
        candidates = self.model_devices(now, moving)
        refused = models.left_out(card, candidates, self.view.announces, context_length)
        devices = [d for d in candidates if d.device_id not in refused]
        if not devices and refused:
            reason = f"no device can serve {model}: {models.why_left(refused)}"
            return [Preview(model, (), (), False, reason, None)]
        families: dict[str, list[Device]] = {}
        for device in devices:  # a split runs on one engine: llama.cpp's, or the torch ring
            families.setdefault(self.family(device.device_id), []).append(device)
        if told:  # the told devices only, in their order (a family is still one engine)
            families = {f: g for f, g in families.items() if {d.device_id for d in g} & set(told)}
            if len(families) > 1:
                reason = "the told devices run different engines: a split runs on one"
                return [Preview(model, (), (), False, reason, None)]
        options: list[Preview] = []
        for family, group in (families or {"ring": []}).items():
            spec = models.spec_for(card, family, self.slots(group, family), precision)
            usable = [d for d in group if d.device_id not in without]
            too_small = models.fleet_too_small(spec, usable, context_length)
            if too_small and usable and not told and shard_count is None:
                options.append(Preview(model, (), (), False, too_small, None))
                continue
            options += models.told_options(
                spec, group, context_length, max_shards, shard_count, told, without
            )
        whole_only = {
            d
            for d, a in self.view.announces.items()
            if a.engines and not SPLITTING_ENGINES & set(a.engines)
        }
        return [models.explain(whole_models_only(o, whole_only), refused) for o in options]

    def context_for(self, model: str, asked: int | None, now: float) -> int:
        """The context a deployment of registered ``model`` gets: what it asks for, else
        ``models.default_context`` over the devices that could hold it."""
        if asked is not None:
            return asked
        return models.default_context(
            self.cards[model], self.model_devices(now), self.view.announces
        )

    def slots(self, devices: list[Device], family: str) -> int:
        """Request slots the engines of ``devices`` run, as their workers announce them (the
        most of them: the KV cache is sized for it), else the engine's default."""
        announced = [
            a.slots
            for d in devices
            if (a := self.view.announces.get(d.device_id)) is not None and a.slots
        ]
        return max(announced, default=ENGINE_SLOTS.get(family, 1))

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

    def no_worker(self) -> set[str]:
        """Devices with no worker engine: nothing loads there, nobody reports."""
        return {d for d, a in self.view.announces.items() if not a.engines}

    async def deploy(self, request: PlacementRequest, now: float) -> PlacementDecision:
        """Plan a model (and its replicas, each on devices of its own where the fleet has
        room) and send its shard tasks: the deployment is pending until its workers report.
        The decision is the first replica's plan."""
        task = request.task
        assert isinstance(task, ModelDeployment)
        existing = self.state.deployments.get(task.deployment_id)
        if existing is not None and existing.phase not in phases.FINAL:
            return self.decision(existing, now)  # idempotent: a repeat gets the live plan
        first_epoch = 1
        for old in self.group(task.deployment_id):  # deployed again after a refusal
            del self.state.deployments[old.deployment_id]
            first_epoch = max(first_epoch, old.epoch + 1)  # late news of the old plan is stale
            if old.phase not in phases.FINAL:  # a replica still serving or loading: drop it
                await self._shard_tasks(old, "unload", now)
                await self.publish(old.model_copy(update={"phase": "removed"}), now)
        if task.model not in self.cards:
            return self.refusal(
                task.deployment_id,
                f"unknown model {task.model!r}; registered: {', '.join(sorted(self.cards))}"
                " (add it with `tessera models add FILE.gguf`)",
                now,
            )
        context_length = self.context_for(task.model, task.context_length, now)
        first: DeploymentState | None = None
        for k in range(1, task.replicas + 1):
            replica_id = task.deployment_id if k == 1 else f"{task.deployment_id}-r{k}"
            taken = {a.device_id for d in self.group(task.deployment_id) for a in d.assignments}
            told = functools.partial(
                self.preview,
                task.model,
                context_length,
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
                if first is not None:  # told n copies: n, or none of them
                    for placed in self.group(task.deployment_id):
                        del self.state.deployments[placed.deployment_id]
                        await self._shard_tasks(placed, "unload", now)
                        await self.publish(placed.model_copy(update={"phase": "removed"}), now)
                    self.persist()
                    reason = f"replica {k} of {task.replicas} not placed: {reason}"
                return self.refusal(task.deployment_id, reason, now)
            deployment = DeploymentState(
                deployment_id=replica_id,
                model=task.model,
                epoch=first_epoch,
                context_length=context_length,
                assignments=assignments_of(chosen),
                replica_of=None if k == 1 else task.deployment_id,
                precision=task.precision,
                max_shards=task.max_shards,
                shard_count=task.shard_count,
                devices=task.devices,
            )
            deployment = await self._send_plan(deployment, now)
            first = first or deployment
            log.info(
                "deployment planned",
                extra={
                    "deployment_id": replica_id,
                    "model": task.model,
                    "devices": [a.device_id for a in deployment.assignments],
                    "phase": deployment.phase,
                },
            )
            if k > 1:
                await self.announce(self.decision(deployment, now))
        self.persist()
        assert first is not None
        return self.decision(first, now)

    async def _send_plan(self, deployment: DeploymentState, now: float) -> DeploymentState:
        """Record ``deployment`` as planned, send its load tasks and publish its status."""
        deployment = phases.planned(deployment, self.no_worker())
        self.state.deployments[deployment.deployment_id] = deployment
        for key in [k for k in self.heard if k[0] == deployment.deployment_id]:
            del self.heard[key]
        for shard in deployment.shards:
            self.heard[(deployment.deployment_id, shard.shard_index)] = now
        await self._shard_tasks(deployment, "load", now)
        await self.publish(deployment, now)
        return deployment

    def refusal(self, deployment_id: str, reason: str, now: float) -> PlacementDecision:
        return PlacementDecision(
            task_id=deployment_id,
            kind="deployment",
            placed=False,
            reason=reason,
            policy="partition",
            mode=self.state.mode,
            ts=now,
            deployment_id=deployment_id,
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
            deployment_id=deployment.deployment_id,
        )

    async def publish(self, deployment: DeploymentState, now: float) -> None:
        status = phases.status_of(deployment, now)
        await self.bus.publish(DEPLOYMENT_STATUS, status, deployment_id=deployment.deployment_id)

    async def publish_all(self, now: float) -> None:
        """Every deployment's status, as it stands."""
        for deployment in list(self.state.deployments.values()):
            await self.publish(deployment, now)

    async def undeploy(self, deployment_id: str) -> bool:
        """Remove a deployment and its replicas (one replica alone: just that one)."""
        if deployment_id not in self.state.deployments:
            return False
        now = self.clock()
        for deployment in self.group(deployment_id):
            del self.state.deployments[deployment.deployment_id]
            await self._shard_tasks(deployment, "unload", now)
            await self.publish(deployment.model_copy(update={"phase": "removed"}), now)
        self.persist()
        return True

    async def _shard_tasks(
        self, deployment: DeploymentState, action: Literal["load", "unload"], now: float
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
            self.cards.get(deployment.model),
        )
        # One JetStream round trip for all: each device's task is on a subject of its own
        # (a device's unload is still stored before its load of the next plan is sent).
        await asyncio.gather(
            *(self.bus.publish_durable(SHARD_TASK, t, device_id=t.device_id) for t in ring)
        )
