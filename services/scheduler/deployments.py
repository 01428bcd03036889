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
only called from the scheduler's command loop (``loop.py``).
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
    ShardProgress,
    ShardStatus,
    ShardTask,
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

#: The shortest silence of a loading worker taken as its end: workers report every second.
MIN_SILENCE_S = 2.0
#: Worker engines that run a layer range of a model (vLLM runs whole models only).
SPLITTING_ENGINES = {"torch", "llamacpp"}
log = logging.getLogger(__name__)


class Deployer:
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
        refused = models.left_out(card, candidates, self.view.announces)
        devices = [d for d in candidates if d.device_id not in refused]
        if not devices and refused:
            reason = f"no device runs an engine that serves {model}: {models.why_left(refused)}"
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
        first: DeploymentState | None = None
        for k in range(1, task.replicas + 1):
            replica_id = task.deployment_id if k == 1 else f"{task.deployment_id}-r{k}"
            taken = {a.device_id for d in self.group(task.deployment_id) for a in d.assignments}
            told = functools.partial(
                self.preview,
                task.model,
                task.context_length,
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
                context_length=task.context_length,
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
