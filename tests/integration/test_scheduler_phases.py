"""Deployments driven by what workers report, on real NATS and Redis: the scheduler in this
process, its workers played by ``Workers`` (they answer each shard task on NATS as a real
worker does: loading with progress, loaded, refused, or nothing at all)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.contracts import (
    DEVICE_FAILED,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SHARD_STATUS,
    SHARD_TASK,
    DeploymentStatus,
    DeviceFailed,
    InferenceRequest,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    ShardStatus,
    ShardTask,
)
from libs.contracts.keys import Keys
from libs.deployments import DeploymentBook, phases
from libs.models.registry import ModelRegistry
from libs.runtime.bus import NatsBus, subscribe
from libs.runtime.following import BookFollower
from libs.runtime.nats_client import ensure_streams
from libs.weights.registration import register_shipped
from services.scheduler.api import create_api
from services.scheduler.checkpoints import CheckpointStore
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.builders import NOW
from tests.unit.services.test_scheduler_handlers import MODEL, seed
from tests.waiting import wait_until

REASON = "needs 0.9 GB of memory, 0.2 GB free"


class Workers:
    """Each device's worker: ``refuse`` (with ``REASON``), ``load`` (loading at half, then
    loaded), ``half`` (loading at half, then nothing) or ``silent``. ``how`` names it by
    device id, by ``shard<i>`` or for the ``first`` device asked; ``load`` unless told."""

    def __init__(self, nc: NatsClient, how: dict[str, str]) -> None:
        self.nc, self.how = nc, how
        self.tasks: list[ShardTask] = []
        self.first: str | None = None

    def behaviour(self, task: ShardTask) -> str:
        self.first = self.first or task.device_id
        for key in (task.device_id, f"shard{task.shard_index}"):
            if key in self.how:
                return self.how[key]
        return self.how.get("first", "load") if task.device_id == self.first else "load"

    async def start(self, uid: str) -> None:
        async def on_task(task: ShardTask, msg: Msg) -> None:
            if not task.device_id.startswith(uid):
                return
            self.tasks.append(task)
            if task.action == "load":
                await self.answer(task, self.behaviour(task))

        await subscribe(self.nc, SHARD_TASK, on_task)

    async def report(self, task: ShardTask, state: str, **fields: Any) -> None:
        status = ShardStatus(
            deployment_id=task.deployment_id,
            device_id=task.device_id,
            shard_index=task.shard_index,
            epoch=task.epoch,
            state=state,
            ts=NOW,
            **fields,
        )
        await NatsBus(self.nc).publish(SHARD_STATUS, status, device_id=task.device_id)

    async def answer(self, task: ShardTask, how: str) -> None:
        if how == "refuse":
            await self.report(task, "refused", reason=REASON)
        elif how in ("load", "half"):
            await self.report(task, "loading", progress=0.5)
            if how == "load":
                await self.report(task, "loaded")

    def loads(self, deployment_id: str) -> list[ShardTask]:
        return [t for t in self.tasks if t.action == "load" and t.deployment_id == deployment_id]


class Setup:
    def __init__(self, nc: NatsClient, redis: Redis, uid: str) -> None:
        self.nc, self.redis, self.uid = nc, redis, uid
        self.bus = NatsBus(nc)
        self.statuses: list[DeploymentStatus] = []
        self.follower = BookFollower()
        self.services: list[Scheduler] = []

    def device(self, name: str) -> str:
        return f"{self.uid}-{name}"

    async def fleet(self, names: tuple[str, ...], memory_gb: float = 4.0) -> None:
        for name in names:
            await seed(self.redis, Keys(self.uid), self.device(name), memory_gb, 1.0)

    async def scheduler(self, **settings: Any) -> Scheduler:
        """A scheduler of this test's devices; a worker silent while loading is taken as
        failed only after a minute unless ``shard_silence_s`` says (None: the devices')."""
        settings = {"shard_silence_s": 60.0} | settings
        config = SchedulerSettings(key_prefix=self.uid, cycle_ms=100, mode_eval_s=3600, **settings)
        keys = Keys(self.uid)
        checkpoints = CheckpointStore(self.redis, None, keys, config.checkpoints_kept)
        await register_shipped(ModelRegistry(self.redis, self.uid))
        service = Scheduler(config, self.bus, self.redis, checkpoints, SchedulerMetrics.create())
        await service.start()
        await self.nc.flush()
        self.services.append(service)
        return service

    async def follow(self) -> None:
        """Follow the deployment book as the gateway does; each change of one of this test's
        deployments is kept as the status it leaves (``removed`` when it is gone)."""

        def changed(before: DeploymentBook, after: DeploymentBook) -> None:
            for name in sorted(set(before.by_id) | set(after.by_id)):
                old, new = before.get(name), after.get(name)
                if not name.startswith(self.uid) or old == new:
                    continue
                if new is None:
                    assert old is not None
                    gone = phases.status_of(old, NOW).model_copy(update={"phase": "removed"})
                    self.statuses.append(gone)
                else:
                    self.statuses.append(phases.status_of(new, NOW))

        self.follower.on_change(changed)
        await self.follower.watch(self.bus)

    async def deploy(self, name: str, **fields: Any) -> PlacementDecision:
        task = ModelDeployment(deployment_id=f"{self.uid}{name}", model=MODEL, **fields)
        request = PlacementRequest(task=task, ts=NOW)
        return await self.bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, 10)

    async def route(self, name: str, i: int) -> PlacementDecision:
        task = InferenceRequest(
            request_id=f"{self.uid}q{i}", model=f"{self.uid}{name}", prompt_tokens=8, max_tokens=8
        )
        request = PlacementRequest(task=task, ts=NOW)
        return await self.bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, 10)

    def phase(self, service: Scheduler, name: str) -> str:
        return service.book.by_id[f"{self.uid}{name}"].phase


@pytest.fixture
async def setup(nc: NatsClient, redis: Redis, uid: str) -> AsyncIterator[Setup]:
    await ensure_streams(nc)
    made = Setup(nc, redis, uid)
    await made.follow()
    yield made
    for service in made.services:
        await service.abandon()


def api(service: Scheduler) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_api(service)), base_url="http://s"
    )


async def test_a_refused_shard_is_placed_elsewhere_with_the_reason_kept_and_never_routed_to(
    setup: Setup,
) -> None:
    await setup.fleet(("a", "b", "c"))
    service = await setup.scheduler()
    await Workers(setup.nc, {"first": "refuse"}).start(setup.uid)
    first = await setup.deploy("d", max_shards=1)
    refuser = first.assignments[0].device_id
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)
    deployment = service.book.by_id[f"{setup.uid}d"]
    assert deployment.epoch >= 2 and refuser not in {a.device_id for a in deployment.assignments}
    assert refuser in deployment.refused_by and REASON in (deployment.reason or "")
    routed = [await setup.route("d", i) for i in range(5)]
    assert all(r.placed for r in routed)
    assert refuser not in {a.device_id for r in routed for a in r.assignments}
    async with api(service) as client:
        shown = (await client.get(f"/placements/{setup.uid}d")).json()
        assert shown["phase"] == "serving" and REASON in shown["reason"]
        [row] = (await client.get("/placements")).json()
        assert row["phase"] == "serving" and row["progress"] == 1.0 and REASON in row["reason"]


async def test_when_every_device_refuses_the_deployment_is_refused_saying_why(
    setup: Setup,
) -> None:
    await setup.fleet(("a", "b"))
    workers = Workers(setup.nc, {setup.device(n): "refuse" for n in ("a", "b")})
    await workers.start(setup.uid)
    service = await setup.scheduler()
    decision = await setup.deploy("d", max_shards=1)
    assert decision.placed  # planned: the workers have not answered yet
    await wait_until(lambda: setup.phase(service, "d") == "refused", 10)
    routed = await setup.route("d", 0)
    assert not routed.placed and "refused" in (routed.reason or "")
    async with api(service) as client:
        shown = DeploymentStatus.model_validate(
            (await client.get(f"/placements/{setup.uid}d")).json()
        )
        assert (await client.get(f"/placements/{setup.uid}nope")).status_code == 404
    assert shown.phase == "refused" and REASON in (shown.reason or "")
    assert "no placement left" in (shown.reason or "")
    await wait_until(lambda: any(s.phase == "refused" for s in setup.statuses), 5)
    # Both devices refused, each once; nothing is left loading on either.
    assert sorted(t.device_id for t in workers.loads(f"{setup.uid}d")) == sorted(
        setup.device(n) for n in ("a", "b")
    )
    assert service.book.reserved_gb() == {}


async def test_progress_is_published_and_it_serves_only_once_every_shard_is_loaded(
    setup: Setup,
) -> None:
    """Two shards (0.45 GB free each: the model needs both); one worker loads, the other
    stays half way: the deployment is loading, at 75 %, and no request goes to it."""
    await setup.fleet(("a", "b", "c"), memory_gb=0.6)
    service = await setup.scheduler()
    workers = Workers(setup.nc, {"shard1": "half"})
    pending = await setup.deploy("d", max_shards=2)
    assert len(pending.assignments) == 2
    early = await setup.route("d", 0)  # no worker has answered yet
    assert not early.placed and "not_serving" in (early.reason or "")
    second = max(pending.assignments, key=lambda a: a.shard_index)
    await workers.start(setup.uid)  # the workers take their tasks now
    service.log.await_devices({d.deployment_id: d.epoch for d in service.book}, NOW)
    await service.loop.call(lambda: service.log.resend(NOW, lambda device: True), "resend")
    await wait_until(lambda: any(s.progress == 0.75 for s in setup.statuses), 10)
    assert setup.phase(service, "d") == "loading"
    assert not (await setup.route("d", 1)).placed
    [task] = [t for t in workers.loads(f"{setup.uid}d") if t.device_id == second.device_id][:1]
    await workers.report(task, "loaded")
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)
    routed = await setup.route("d", 2)
    assert routed.placed and routed.deployment_id == f"{setup.uid}d"
    phases = [s.phase for s in setup.statuses]
    assert phases[0] == "pending" and phases[-1] == "serving" and "loading" in phases


async def test_a_worker_that_dies_while_loading_gets_its_deployment_replanned(
    setup: Setup,
) -> None:
    await setup.fleet(("a", "b"))
    service = await setup.scheduler()
    await Workers(setup.nc, {"first": "half"}).start(setup.uid)
    decision = await setup.deploy("d", max_shards=1)
    dead = decision.assignments[0].device_id
    await wait_until(lambda: setup.phase(service, "d") == "loading", 10)
    failed = DeviceFailed(device_id=dead, ts=NOW, last_seen_ts=NOW - 3, missed_heartbeats=3)
    await setup.bus.publish(DEVICE_FAILED, failed, device_id=dead)
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)
    deployment = service.book.by_id[f"{setup.uid}d"]
    assert dead not in {a.device_id for a in deployment.assignments}
    assert f"device {dead} failed" in (deployment.reason or "")


async def test_a_worker_silent_while_loading_gets_its_deployment_replanned(
    setup: Setup,
) -> None:
    await setup.fleet(("a", "b"))
    # The bound is the devices' own: three telemetry intervals of 1 s.
    service = await setup.scheduler(shard_silence_s=None)
    workers = Workers(setup.nc, {setup.device("a"): "silent", setup.device("b"): "silent"})
    await workers.start(setup.uid)
    decision = await setup.deploy("d", max_shards=1)
    quiet = decision.assignments[0].device_id
    # Its worker never answers: after the bound the other device gets the plan; it loads.
    workers.how[next(d for d in workers.how if d != quiet)] = "load"
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)
    deployment = service.book.by_id[f"{setup.uid}d"]
    assert quiet not in {a.device_id for a in deployment.assignments}
    assert f"no report while loading from {quiet} for 3 s" in (deployment.reason or "")
    assert quiet not in deployment.refused_by  # it may come back: left out of that plan only


async def test_a_report_of_an_older_epoch_is_ignored(setup: Setup) -> None:
    await setup.fleet(("a", "b"))
    service = await setup.scheduler()
    workers = Workers(setup.nc, dict.fromkeys((setup.device("a"), setup.device("b")), "silent"))
    await workers.start(setup.uid)
    decision = await setup.deploy("d", max_shards=1)
    lost = decision.assignments[0].device_id
    failed = DeviceFailed(device_id=lost, ts=NOW, last_seen_ts=NOW - 3, missed_heartbeats=3)
    await setup.bus.publish(DEVICE_FAILED, failed, device_id=lost)
    await wait_until(lambda: service.book.by_id[f"{setup.uid}d"].epoch == 2, 10)
    [old] = [t for t in workers.loads(f"{setup.uid}d") if t.epoch == 1]
    [new] = [t for t in workers.loads(f"{setup.uid}d") if t.epoch == 2]
    await workers.report(old, "loaded")  # epoch 1's worker, late
    await workers.report(old, "refused", reason=REASON)
    await workers.report(new, "loading", progress=0.25)  # applied after them, in order
    await wait_until(lambda: any(s.progress == 0.25 for s in setup.statuses), 10)
    deployment = service.book.by_id[f"{setup.uid}d"]
    assert deployment.phase == "loading" and deployment.epoch == 2 and not deployment.refused_by


async def test_an_undeploy_and_a_failure_at_once_leave_one_consistent_state(
    setup: Setup,
) -> None:
    """The HTTP undeploy and the device-failed event are applied one after the other: the
    deployment is gone, and the last task each device got for it is an unload."""
    await setup.fleet(("a", "b", "c"))
    service = await setup.scheduler()
    workers = Workers(setup.nc, {})
    await workers.start(setup.uid)
    decision = await setup.deploy("d", max_shards=1)
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)
    host = decision.assignments[0].device_id
    failed = DeviceFailed(device_id=host, ts=NOW, last_seen_ts=NOW - 3, missed_heartbeats=3)
    async with api(service) as client:
        answers = await asyncio.gather(
            setup.bus.publish(DEVICE_FAILED, failed, device_id=host),
            client.delete(f"/placements/{setup.uid}d"),
        )
        assert answers[1].status_code == 204
        await wait_until(lambda: any(s.phase == "removed" for s in setup.statuses), 10)
        # The failure is applied too (before or after): a barrier through the loop.
        await asyncio.sleep(0.2)
        await service.loop.call(lambda: asyncio.sleep(0), "barrier")
        assert (await client.get("/placements")).json() == []
    assert f"{setup.uid}d" not in service.book
    last: dict[str, ShardTask] = {}
    for task in workers.tasks:
        if task.deployment_id == f"{setup.uid}d":
            last[task.device_id] = task
    assert last and all(t.action == "unload" for t in last.values()), last
    assert setup.statuses[-1].phase == "removed"


async def test_a_restarted_scheduler_keeps_each_deployments_phase(setup: Setup) -> None:
    await setup.fleet(("a", "b", "c"))
    refuse_all = {setup.device(n): "refuse" for n in ("a", "b", "c")}
    workers = Workers(setup.nc, refuse_all)
    await workers.start(setup.uid)
    service = await setup.scheduler()
    await setup.deploy("gone", max_shards=1)
    await wait_until(lambda: setup.phase(service, "gone") == "refused", 10)
    workers.how = dict.fromkeys(refuse_all, "half")
    await setup.deploy("half", max_shards=1)
    await wait_until(lambda: setup.phase(service, "half") == "loading", 10)
    await service.stop()
    setup.services.remove(service)
    sent = len(workers.tasks)
    # No agent answers this test's announce request: the plan waits 0.5 s for its devices.
    again = await setup.scheduler(resume_wait_s=0.5)
    assert setup.phase(again, "gone") == "refused" and setup.phase(again, "half") == "loading"
    assert REASON in (again.book.by_id[f"{setup.uid}gone"].reason or "")
    # The plan still loading is sent again (its workers' reports may have been lost).
    await wait_until(
        lambda: any(t.deployment_id == f"{setup.uid}half" for t in workers.tasks[sent:]), 10
    )


async def test_a_worker_still_loading_a_replanned_epoch_is_told_once_to_drop_it(
    setup: Setup,
) -> None:
    """A worker that comes back and loads the plan it was killed in (its load delivered
    again after the re-plan) is told to unload that epoch: once, however often it reports."""
    await setup.fleet(("a", "b"))
    service = await setup.scheduler()
    workers = Workers(setup.nc, {"first": "half"})
    await workers.start(setup.uid)
    decision = await setup.deploy("d", max_shards=1)
    dead = decision.assignments[0].device_id
    await wait_until(lambda: setup.phase(service, "d") == "loading", 10)
    failed = DeviceFailed(device_id=dead, ts=NOW, last_seen_ts=NOW - 3, missed_heartbeats=3)
    await setup.bus.publish(DEVICE_FAILED, failed, device_id=dead)
    await wait_until(lambda: setup.phase(service, "d") == "serving", 10)

    def unloads() -> int:
        return sum(
            t.action == "unload" and t.device_id == dead and t.epoch == 1 for t in workers.tasks
        )

    replanned = unloads()  # the re-plan's own unload of the old plan
    [old] = [t for t in workers.loads(f"{setup.uid}d") if t.device_id == dead]
    for _ in range(3):  # back, loading epoch 1 again, and reporting it
        await workers.report(old, "loading", progress=0.5)
    await wait_until(lambda: unloads() == replanned + 1, 10)
    await service.loop.call(lambda: asyncio.sleep(0), "drain")
    await setup.nc.flush()
    assert unloads() == replanned + 1
    assert setup.phase(service, "d") == "serving"
    assert dead not in {a.device_id for a in service.book.by_id[f"{setup.uid}d"].assignments}
