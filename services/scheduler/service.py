"""The scheduler: a thin shell that feeds the core, publishes its decisions and keeps state.

State changes in one place: the command loop (``loop.py``). NATS handlers, HTTP handlers and
timers only queue commands; one task applies them in order. Requests are collected between
cycles and decided together every ``cycle_ms``, except an inference request for a deployed
model, routed at once to a serving copy (``routing.py``). What is deployed is the deployment
book (``libs/deployments``): the deployer's commands return changes, ``DeploymentLog`` records
them as indexed events, sends their shard tasks and publishes them; what a deployment measured
is recorded beside its prediction (``speeds.py``). Failed devices' shards and tasks move to
the best alternatives. The state is checkpointed every ``checkpoint_interval_s``, after each
change of placement, and at shutdown.

The parts, each with its own narrow job: ``ClusterView`` (devices as scored), ``Planner``
(where a model can go), ``Deployer`` (deployment commands), ``DeploymentLog`` (the book and
its events), ``Router`` (which copy serves a request), ``ModeKeeper`` (mode, policy, DVFS
hints), ``Checkpointer`` (snapshots stored by a writer).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import numpy as np
from redis.asyncio import Redis

from libs.contracts import (
    DEPLOYMENT_MEASURED,
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    PLACEMENT_REQUEST,
    SCORE,
    SHARD_STATUS,
    DeploymentChange,
    DeploymentMeasured,
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
from libs.core.fleet_state import FleetState
from libs.deployments import DeploymentBook
from libs.models.registry import ModelRegistry
from libs.runtime.bus import Bus, Delivery
from libs.runtime.lifecycle import Background
from services.scheduler import speeds
from services.scheduler.checkpoints import Checkpointer, CheckpointStore, checkpoint_of
from services.scheduler.decisions import Announcer, plan_decision, refusal
from services.scheduler.deployment_log import DeploymentLog
from services.scheduler.deployments import Deployer
from services.scheduler.loop import CommandLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.mode_keeper import ModeKeeper
from services.scheduler.planning import Planner
from services.scheduler.restart import reconcile
from services.scheduler.routing import Router
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import Pending, TaskState
from services.scheduler.tasking import TaskPlacer
from services.scheduler.view import ClusterView, Read

log = logging.getLogger(__name__)

#: Seconds between two publications of the whole book (each change goes out at once).
SNAPSHOT_EVERY_S = 15.0


class Scheduler:
    def __init__(
        self,
        settings: SchedulerSettings,
        bus: Bus,
        redis: Redis,
        checkpoints: CheckpointStore,
        metrics: SchedulerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.bus, self.metrics, self.clock = settings, bus, metrics, clock
        keys = Keys(settings.key_prefix)
        self.view = ClusterView(redis, keys)
        #: The models the cluster knows (``libs/models/registry.py``).
        self.registry = ModelRegistry(redis, settings.key_prefix)
        self.checkpoints = checkpoints
        self.checkpointer = Checkpointer(checkpoints, metrics)
        self.tasks = TaskState.keeping(settings.decisions_kept)
        self.modes = ModeKeeper(
            settings.mode, settings.policy, settings.mode_dwell_s,
            bus=bus, redis=redis, keys=keys, metrics=metrics, view=self.view, clock=clock,
        )  # fmt: skip
        rng = np.random.default_rng(0)
        self.planner = Planner(self.view, self.tasks.load_by_device)
        self.deployer = Deployer(self.planner, self.view, settings.shard_silence_s)
        #: This leadership's term: followers know a new leader's events by it.
        self.log = DeploymentLog(bus, self.deployer, metrics, term=uuid.uuid4().hex[:16])
        self.router = Router(self.planner, self.view, rng)
        self.placer = TaskPlacer(self.planner, metrics, rng)
        self.announcer = Announcer(bus, metrics, self.view, self.tasks)
        self.pending: list[Pending] = []
        #: Devices whose scores changed: read before the next cycle (an input, not state).
        self.to_refresh: set[str] = set()
        self.background = Background("scheduler")
        self.loop = CommandLoop()
        metrics.cycle.set(settings.cycle_ms / 1000)
        metrics.checkpoint_interval.set(settings.checkpoint_interval_s)

    @property
    def book(self) -> DeploymentBook:
        """What is deployed, as the events so far left it."""
        return self.log.book

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.view.load()
        for card in await self.registry.list():  # the deployments restored below need theirs
            self.planner.cards[card.name] = card
        checkpoint = await self.checkpoints.load()
        if checkpoint is not None:
            self.restore(checkpoint)
        await self.modes.store()
        self.modes.show()
        self.loop.start()
        self.checkpointer.start()
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
            await self.bus.subscribe(DEPLOYMENT_MEASURED, self.on_measured, rejected=rejected),
        ]
        await reconcile(
            self.view,
            self.log,
            self.loop,
            self.bus,
            self.background,
            self._fail,
            self.clock,
            self.settings.resume_wait_s,
        )
        self.background.every(
            SNAPSHOT_EVERY_S,
            lambda: self.loop.call(lambda: self.log.publish_snapshot(self.clock()), "snapshot"),
        )
        self.background.every(self.settings.cycle_ms / 1000, self.tick)
        self.background.every(self.settings.checkpoint_interval_s, self.save_soon)
        self.background.every(self.settings.mode_eval_s, self.evaluate_mode_soon)

    def restore(self, checkpoint: SchedulerCheckpoint) -> None:
        """Take up a checkpoint's state: its book replaces ours, its mode and policy ours."""
        book = DeploymentBook.holding(checkpoint.deployments, checkpoint.deployment_index)
        self.log.restore(book)
        self.modes.restore(checkpoint.mode, checkpoint.policy)
        self.tasks.decisions.extend(checkpoint.placements)
        counters = dict(checkpoint.counters)
        self.modes.changes = counters.pop("mode_changes", 0)  # the mode keeper counts these
        self.tasks.counters.update(counters)
        self.pending = [(r, None, None) for r in checkpoint.queue]
        self.planner.factors = dict(checkpoint.factors)
        log.info(
            "restored checkpoint",
            extra={
                "checkpoint_ts": checkpoint.ts,
                "deployments": len(self.book),
                "mode": checkpoint.mode.value,
                "corrupt_skipped": self.checkpoints.corrupt_seen,
            },
        )

    def checkpoint(self, now: float) -> SchedulerCheckpoint:
        queue = [r for r, _, _ in self.pending]
        return checkpoint_of(self.book, self.modes, self.tasks, queue, now, self.planner.factors)

    async def stop(self) -> None:
        """Stop taking news, apply the commands already queued, and save the state."""
        await self.background.close()
        await self.loop.close(drain_s=5.0)
        self._drop_waiting()
        await self.checkpointer.stop()
        await self.save()

    async def abandon(self) -> None:
        """Stop deciding and write nothing: the lease is lost and another replica leads."""
        await self.background.close()
        await self.loop.close()
        self._drop_waiting()
        await self.checkpointer.stop()

    def _drop_waiting(self) -> None:
        """The loop is closed: whoever waits on a queued request is told (an HTTP deploy
        would otherwise hang)."""
        for _, _, future in self.pending:
            if future is not None and not future.done():
                future.cancel()

    def _rejected(self, channel: str, reason: str, detail: str) -> None:
        self.metrics.rejections.labels(f"bad_message:{reason}").inc()

    # -- checkpoints --------------------------------------------------------------------------
    def persist(self) -> None:
        """Snapshot the state for the writer (called by commands, in the loop)."""
        self.checkpointer.offer(self.checkpoint(self.clock()))

    async def save_soon(self) -> None:
        """The periodic checkpoint: snapshot in the loop's turn, stored by the writer."""

        async def snapshot() -> None:
            self.persist()

        await self.loop.call(snapshot, "checkpoint")

    async def save(self) -> None:
        """Snapshot now and store it before returning (at shutdown; the loop has stopped)."""
        self.persist()
        await self.checkpointer.write()

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
            self.planner.cards.pop(model, None)
        else:
            self.planner.cards[model] = card

    async def on_score(self, update: ScoreUpdate, msg: Delivery) -> None:
        if not self.view.receive(update):  # a device it does not know yet: read at the tick
            self.to_refresh.add(update.device_id)

    async def on_failed(self, event: DeviceFailed, msg: Delivery) -> None:
        self.loop.post(lambda: self._fail(event.device_id), "device failed")

    async def on_recovered(self, event: DeviceRecovered, msg: Delivery) -> None:
        self.loop.post(lambda: self._recover(event.device_id), "device recovered")

    async def on_shard_status(self, status: ShardStatus, msg: Delivery) -> None:
        self.loop.post(lambda: self._report(status), "shard status")

    async def on_measured(self, news: DeploymentMeasured, msg: Delivery) -> None:
        async def record() -> None:
            now = self.clock()
            await self._commit(speeds.measured(self.planner, self.book, news, now), now)

        self.loop.post(record, "measured")

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

        async def command() -> bool:
            changes = self.deployer.undeploy(self.book, deployment_id)
            if changes is None:
                return False
            await self._commit(changes, self.clock())
            return True

        return await self.loop.call(command, "undeploy")

    # -- commands (applied by the loop only) ----------------------------------------------------
    async def _commit(
        self, changes: list[DeploymentChange], now: float, answered: str | None = None
    ) -> None:
        """Apply deployment changes; every plan but the one ``answered`` to its caller is
        announced as a decision, and the state saved when a plan or a phase changed."""
        committed = await self.log.commit(changes, now)
        self.tasks.counters["migrations"] += committed.replans
        for plan in committed.plans:
            if plan.deployment_id != answered:
                await self.announcer.announce(plan_decision(plan, self.modes.mode, now), None, None)
        if committed.save:
            self.persist()  # a restart must not bring back the placement before the move

    async def _report(self, status: ShardStatus) -> None:
        now = self.clock()
        await self.log.unload_stale(status, now)
        await self._commit(self.deployer.report(self.book, status, now), now)

    async def _request(self, request: PlacementRequest, reply: str | None) -> None:
        task = request.task
        if isinstance(task, InferenceRequest):
            deployment = self.router.named(self.book, task)
            if deployment is not None:  # routed at once: no need to wait for the next cycle
                started = time.perf_counter()
                modes = self.modes
                decision = self.router.route(
                    self.book,
                    request,
                    deployment,
                    self.clock(),
                    modes.policy,
                    modes.policy_name,
                    modes.mode,
                )
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
                await self.announcer.announce(decision, reply, None)
                return
        self.pending.append((request, reply, None))

    async def _fail(self, device_id: str) -> None:
        """A failed device: its shards are re-planned now, its tasks go back to the queue."""
        self.view.mark_failed(device_id)
        now = self.clock()
        await self._commit(self.deployer.migrate(self.book, device_id, now), now)
        for active in self.placer.take_back(self.tasks, device_id):
            self.pending.append((active.request, None, None))
            self.tasks.counters["migrations"] += 1
            self.metrics.migrations.inc()

    async def _recover(self, device_id: str) -> None:
        self.view.mark_recovered(device_id)
        self.to_refresh.add(device_id)

    # -- the decision cycle -------------------------------------------------------------------
    async def tick(self) -> None:
        """Every ``cycle_ms``: take the score updates received, read the devices the view
        cannot update from them (outside the loop), then run the cycle as a command."""
        refresh, self.to_refresh = sorted(self.to_refresh), set()
        read = self.view.take_received() + await self.view.read(refresh)
        await self.loop.call(lambda: self.cycle(read), "cycle")

    async def cycle(self, read: Read | None = None) -> None:
        now = self.clock()
        self.view.apply(read or [])
        # Devices started again since: their plans' tasks, with the addresses of now.
        if renewed := self.view.take_renewed():
            await self.log.resend_to(renewed, now)
        await self._commit(self.deployer.check_silence(self.book, now), now)
        batch, self.pending = self.pending, []
        self.metrics.queue.set(len(batch))
        if not batch:
            return
        tasks = [(r, reply, f) for r, reply, f in batch if not isinstance(r.task, ModelDeployment)]
        for request, reply, future in batch:
            if isinstance(request.task, ModelDeployment):
                decision = await self._deploy(request.task, now)
                await self.announcer.announce(decision, reply, future)
        fleet = FleetState(self.planner.devices(self.book, now))
        if tasks:
            modes = self.modes
            placed = self.placer.place(
                self.book, tasks, now, modes.policy, modes.policy_name, modes.mode, self.tasks
            )
            for (reply, future), decision in placed.decisions:
                await self.announcer.announce(decision, reply, future)
            fleet = placed.fleet
        await self.modes.send_hints(fleet, self.tasks.urgent_devices(), now)

    async def _deploy(self, task: ModelDeployment, now: float) -> PlacementDecision:
        """Plan a deployment and send it: the decision is its first copy's plan."""
        outcome = self.deployer.deploy(self.book, task, now)
        try:
            await self._commit(outcome.changes, now, answered=outcome.deployment_id)
        except Exception as exc:  # the bus down mid-plan: say so, go on with the batch
            log.exception("deploy failed", extra={"task_id": task.deployment_id})
            reason = f"could not send the plan ({type(exc).__name__}); deploy again"
            return refusal(task.deployment_id, reason, self.modes.mode, now)
        if outcome.refused is not None:
            return refusal(task.deployment_id, outcome.refused, self.modes.mode, now)
        placed = self.book.get(outcome.deployment_id)
        assert placed is not None
        return plan_decision(placed, self.modes.mode, now)

    async def evaluate_mode_soon(self) -> None:
        """Every ``mode_eval_s``: read the live devices (outside the loop), then evaluate the
        mode as a command."""
        read = await self.view.read(sorted(set(self.view.rows) - self.view.failed))
        await self.loop.call(lambda: self.modes.evaluate(read), "mode")
