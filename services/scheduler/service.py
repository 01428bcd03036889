"""The scheduler: a thin shell that feeds the core, publishes its decisions and keeps state.

State changes in one place: the command loop (``loop.py``). NATS handlers, HTTP handlers and
timers only queue commands; one task applies them in order. Requests are collected between
cycles and decided together every ``cycle_ms``, except an inference request for a deployed
model, routed at once to a serving copy (``deployments.py``). Workers' shard reports move
deployments through their phases; failed devices' shards and tasks move to the best
alternatives. The state is checkpointed every ``checkpoint_interval_s``, after each change of
placement, and at shutdown: the loop takes the snapshot, a writer stores it (``checkpoints.py``).
The mode, the policy and the DVFS hints are ``modes.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import numpy as np
from redis.asyncio import Redis

from libs.contracts import (
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SCORE,
    SHARD_STATUS,
    DeviceFailed,
    DeviceRecovered,
    InferenceRequest,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    SchedulerCheckpoint,
    ScoreUpdate,
    ShardStatus,
)
from libs.contracts.keys import Keys
from libs.core.fleet import FleetState
from libs.core.model import Device
from libs.core.modes import ModeSwitcher
from libs.core.profiles import BUILTIN_PROFILES
from libs.core.registry import make_policy
from libs.models.registry import ModelRegistry
from libs.runtime.bus import Bus, Delivery
from libs.runtime.lifecycle import Background
from services.scheduler.checkpoints import Checkpointing, CheckpointStore
from services.scheduler.deployments import Deployer
from services.scheduler.loop import CommandLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.modes import ModeKeeping
from services.scheduler.routing import Router
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import ActiveTask, Pending, SchedulerState
from services.scheduler.tasks import decision_for, expected_seconds, to_task
from services.scheduler.view import ClusterView, Read

log = logging.getLogger(__name__)

#: Seconds between two publications of every deployment's status (each change goes out at once).
STATUS_EVERY_S = 15.0


class Scheduler(ModeKeeping, Checkpointing):
    def __init__(
        self,
        settings: SchedulerSettings,
        bus: Bus,
        redis: Redis,
        checkpoints: CheckpointStore,
        metrics: SchedulerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.bus, self.redis, self.metrics, self.clock = (
            settings,
            bus,
            redis,
            metrics,
            clock,
        )
        self.keys = Keys(settings.key_prefix)
        self.view = ClusterView(redis, self.keys)
        #: The models the cluster knows (``libs/models/registry.py``).
        self.registry = ModelRegistry(redis, settings.key_prefix)
        self.checkpoints = checkpoints
        self.state = SchedulerState(
            mode=settings.mode, policy=settings.policy, profile=BUILTIN_PROFILES[settings.mode]
        )
        self.switcher = ModeSwitcher(mode=settings.mode, dwell_s=settings.mode_dwell_s)
        self.policy = make_policy(self.state.policy, self.state.profile)
        self.pending: list[Pending] = []
        #: Devices whose scores changed: read before the next cycle (an input, not state).
        self.to_refresh: set[str] = set()
        self.hints: dict[str, tuple[float, float]] = {}  #: (clock share, sleep after) sent
        self.rng = np.random.default_rng(0)
        self.background = Background("scheduler")
        self.loop = CommandLoop()
        self._snapshot: SchedulerCheckpoint | None = None  #: the newest, for the writer
        self._to_write = asyncio.Event()
        self._writing: asyncio.Task[None] | None = None
        self.deployments = Deployer(
            self.state,
            self.view,
            bus,
            metrics,
            clock,
            devices=self.devices,
            persist=self.persist,
            announce=lambda decision: self._announce(decision, None, None),
            silence_s=settings.shard_silence_s,
        )
        self.router = Router(self.deployments, lambda: self.policy, self.rng)
        metrics.cycle.set(settings.cycle_ms / 1000)
        metrics.checkpoint_interval.set(settings.checkpoint_interval_s)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.view.load()
        for card in await self.registry.list():  # the deployments restored below need theirs
            self.deployments.cards[card.name] = card
        checkpoint = await self.checkpoints.load()
        if checkpoint is not None:
            self.state = SchedulerState.restore(checkpoint, self.settings.decisions_kept)
            self.deployments.state = self.state
            self.switcher.mode = self.state.mode
            self.policy = make_policy(self.state.policy, self.state.profile)
            log.info(
                "restored checkpoint",
                extra={
                    "checkpoint_ts": checkpoint.ts,
                    "deployments": len(self.state.deployments),
                    "mode": self.state.mode.value,
                    "corrupt_skipped": self.checkpoints.corrupt_seen,
                },
            )
        await self._store_mode()
        self._show_mode()
        self.pending = [(r, None, None) for r in self.state.queue]
        self.loop.start()
        self._writing = asyncio.create_task(self._writer())
        # Listening first: workers' answers to what the reconciling sends are not missed.
        rejected = self._rejected
        self.background.subscriptions += [
            await self.bus.subscribe(
                PLACEMENT_REQUEST, self.on_request, queue="scheduler", rejected=rejected
            ),
            await self.bus.subscribe(SCORE, self.on_score, rejected=rejected),
            await self.bus.subscribe(DEVICE_FAILED, self.on_failed, rejected=rejected),
            await self.bus.subscribe(DEVICE_RECOVERED, self.on_recovered, rejected=rejected),
            await self.bus.subscribe(SHARD_STATUS, self.on_shard_status, rejected=rejected),
        ]
        # Reconcile with live telemetry: devices gone since the checkpoint count as failed;
        # plans still loading are sent again, as their workers' reports may have been lost.
        known = set(self.view.rows)
        gone = {
            a.device_id
            for deployment in self.state.deployments.values()
            for a in deployment.assignments
            if a.device_id not in known or a.device_id in self.view.failed
        }
        for device_id in sorted(gone):
            self.loop.post(functools.partial(self._fail, device_id), "reconcile")
        epochs = {d.deployment_id: d.epoch for d in self.state.deployments.values()}

        async def resume() -> None:
            now = self.clock()
            self.deployments.restored(now)
            await self.deployments.resend(now, epochs)  # the plans not re-planned just now
            await self.deployments.publish_all(now)

        self.loop.post(resume, "resume")
        # Statuses go out on every change; all of them again now and then, so a gateway that
        # missed one (a reconnect, a restart) catches up without polling.
        self.background.every(
            STATUS_EVERY_S,
            lambda: self.loop.call(lambda: self.deployments.publish_all(self.clock()), "statuses"),
        )
        self.background.every(self.settings.cycle_ms / 1000, self.tick)
        self.background.every(self.settings.checkpoint_interval_s, self.save_soon)
        self.background.every(self.settings.mode_eval_s, self.evaluate_mode_soon)

    async def stop(self) -> None:
        """Stop taking news, apply the commands already queued, and save the state."""
        await self.background.close()
        await self.loop.close(drain_s=5.0)
        self._drop_waiting()
        await self._stop_writing()
        await self.save()

    async def abandon(self) -> None:
        """Stop deciding and write nothing: the lease is lost and another replica leads."""
        await self.background.close()
        await self.loop.close()
        self._drop_waiting()
        await self._stop_writing()

    def _drop_waiting(self) -> None:
        """The loop is closed: whoever waits on a queued request is told (an HTTP deploy
        would otherwise hang)."""
        for _, _, future in self.pending:
            if future is not None and not future.done():
                future.cancel()

    async def _stop_writing(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writing
            self._writing = None

    def _rejected(self, channel: str, reason: str, detail: str) -> None:
        self.metrics.rejections.labels(f"bad_message:{reason}").inc()

    # -- events: each queues a command -------------------------------------------------------
    async def on_request(self, request: PlacementRequest, msg: Delivery) -> None:
        if isinstance(request.task, ModelDeployment):
            await self.learn(request.task.model)
        self.loop.post(lambda: self._request(request, msg.reply or None), "request")

    async def learn(self, model: str) -> None:
        """Read ``model``'s card from the registry (outside the loop) for the deploy that
        names it: a model removed since is forgotten, one added since is learnt."""
        card = await self.registry.get(model)
        if card is None:
            self.deployments.cards.pop(model, None)
        else:
            self.deployments.cards[model] = card

    async def on_score(self, update: ScoreUpdate, msg: Delivery) -> None:
        if not self.view.receive(update):  # a device it does not know yet: read at the tick
            self.to_refresh.add(update.device_id)

    async def on_failed(self, event: DeviceFailed, msg: Delivery) -> None:
        self.loop.post(lambda: self._fail(event.device_id), "device failed")

    async def on_recovered(self, event: DeviceRecovered, msg: Delivery) -> None:
        self.loop.post(lambda: self._recover(event.device_id), "device recovered")

    async def on_shard_status(self, status: ShardStatus, msg: Delivery) -> None:
        self.loop.post(lambda: self.deployments.on_status(status, self.clock()), "shard status")

    async def submit(self, request: PlacementRequest) -> PlacementDecision:
        """Queue a request for the next cycle and wait for its decision (HTTP API)."""
        future: asyncio.Future[PlacementDecision] = asyncio.get_running_loop().create_future()
        if isinstance(request.task, ModelDeployment):
            await self.learn(request.task.model)

        async def queue() -> None:
            self.pending.append((request, None, future))

        self.loop.post(queue, "submit")
        return await future

    async def undeploy(self, deployment_id: str) -> bool:
        """Remove a deployment and its replicas (HTTP API), in the loop's order."""
        return await self.loop.call(lambda: self.deployments.undeploy(deployment_id), "undeploy")

    # -- commands (applied by the loop only) ----------------------------------------------------
    async def _request(self, request: PlacementRequest, reply: str | None) -> None:
        task = request.task
        if isinstance(task, InferenceRequest):
            deployment = self.router.named(task.model)
            if deployment is not None:  # routed at once: no need to wait for the next cycle
                started = time.perf_counter()
                decision = self.router.route(request, deployment, self.clock())
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
                await self._announce(decision, reply, None)
                return
        self.pending.append((request, reply, None))

    async def _fail(self, device_id: str) -> None:
        """A failed device: its shards are re-planned now, its tasks go back to the queue."""
        self.view.mark_failed(device_id)
        await self.migrate(device_id, self.clock())

    async def _recover(self, device_id: str) -> None:
        self.view.mark_recovered(device_id)
        self.to_refresh.add(device_id)

    # -- the decision cycle -------------------------------------------------------------------
    def devices(self, now: float, moving: str | None = None) -> list[Device]:
        """The fleet as the core sees it; memory held by deployments is not free, except that
        of deployment ``moving`` (being re-placed: its old shards are dropped)."""
        reserved = self.state.reserved_memory_gb(without=moving)
        return self.view.devices(self.state.load_by_device(now), reserved)

    async def tick(self) -> None:
        """Every ``cycle_ms``: take the score updates received, read the devices the view
        cannot update from them (outside the loop), then run the cycle as a command."""
        refresh, self.to_refresh = sorted(self.to_refresh), set()
        read = self.view.take_received() + await self.view.read(refresh)
        await self.loop.call(lambda: self.cycle(read), "cycle")

    async def cycle(self, read: Read | None = None) -> None:
        now = self.clock()
        self.view.apply(read or [])
        await self.deployments.check_silence(now)
        batch, self.pending = self.pending, []
        self.metrics.queue.set(len(batch))
        if not batch:
            return
        tasks = [(r, reply, f) for r, reply, f in batch if not isinstance(r.task, ModelDeployment)]
        for request, reply, future in batch:
            if isinstance(request.task, ModelDeployment):
                try:
                    decision = await self.deployments.deploy(request, now)
                except Exception as exc:  # the bus down mid-plan: say so, go on with the batch
                    log.exception("deploy failed", extra={"task_id": request.task_id})
                    reason = f"could not send the plan ({type(exc).__name__}); deploy again"
                    decision = self.deployments.refusal(request.task.deployment_id, reason, now)
                await self._announce(decision, reply, future)
        fleet = await self._place_tasks(tasks, now) if tasks else FleetState(self.devices(now))
        await self._send_hints(fleet, now)

    async def _place_tasks(self, batch: list[Pending], now: float) -> FleetState:
        """Place a cycle's inference requests and jobs; returns the fleet as they left it."""
        devices = self.devices(now)
        fleet = FleetState(devices)
        by_id = {d.device_id: d for d in devices}
        core_tasks = [
            to_task(r, self.deployments.spec_of(getattr(r.task, "model", ""))) for r, _, _ in batch
        ]
        started = time.perf_counter()
        placements = self.policy.place(fleet, core_tasks, now, self.rng)
        per_task = (time.perf_counter() - started) / max(1, len(core_tasks))
        for (request, reply, future), placement in zip(batch, placements, strict=True):
            self.metrics.decision_seconds.observe(per_task)
            decision = decision_for(request, placement, self.state.policy, self.state.mode, now)
            if placement.device_id is not None:
                self.metrics.match_score.observe(placement.score)
                device = by_id[placement.device_id]
                until = now + expected_seconds(request, device.speed)
                self.state.active[request.task_id] = ActiveTask(
                    request.task_id, placement.device_id, until, request
                )
            await self._announce(decision, reply, future)
        return fleet

    async def migrate(self, device_id: str, now: float) -> None:
        """Move every shard and task of a failed device to the best alternatives: shards
        through the deployments, tasks back to the queue for the next cycle."""
        await self.deployments.migrate(device_id, now)
        moved = [a for a in self.state.active.values() if a.device_id == device_id]
        for active in moved:
            del self.state.active[active.task_id]
            self.pending.append((active.request, None, None))
            self.state.counters["migrations"] += 1
            self.metrics.migrations.inc()

    async def _announce(
        self,
        decision: PlacementDecision,
        reply: str | None,
        future: asyncio.Future[PlacementDecision] | None,
    ) -> None:
        """Publish a decision, answer its caller, and account for it."""
        self.state.decisions.appendleft(decision)
        if decision.placed:
            self.state.counters["placed"] += 1
            for a in decision.assignments:
                cls = self.view.announces.get(a.device_id)
                self.metrics.assignments.labels(
                    decision.policy, cls.device_class.value if cls else "unknown"
                ).inc()
        else:
            self.state.counters["rejected"] += 1
            self.metrics.rejections.labels((decision.reason or "unknown").split(":")[0]).inc()
        if reply:  # the caller first (the gateway waits on it), then the broadcast
            await self.bus.reply(reply, PLACEMENT_DECISION, decision)
        if future is not None and not future.done():
            future.set_result(decision)
        await self.bus.publish(PLACEMENT_DECISION, decision, task_id=decision.task_id)
