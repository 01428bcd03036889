"""The scheduler service on real NATS + Redis with emulated fleets (all real processes)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import (
    DEVICE_FAILED,
    MODE_CHANGE,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SHARD_TASK,
    Demand,
    InferenceRequest,
    PlacementRequest,
)
from libs.contracts.keys import Keys
from libs.core.catalogue import card_spec
from libs.core.partition import choose, previews
from libs.models.registry import register_sync
from libs.models.shipped import shipped_card
from libs.runtime.bus import subscribe
from libs.runtime.procs import free_port
from services.scheduler.view import ClusterView
from tests.processes import ServiceProcess
from tests.waiting import wait_until, wait_until_async

INTERVAL_S = 1.0
SMOL = "smollm2-135m-instruct"


class Cluster:
    """Scorer + fleet agents + scheduler for one test, under a unique key prefix."""

    def __init__(self, nats: NatsServer, redis: RedisServer, uid: str, tmp: Path) -> None:
        self.uid, self.tmp, self.port = uid, tmp, free_port()
        self.env = {
            "TESSERA_NATS_URL": nats.url,
            "TESSERA_REDIS_URL": redis.url,
            "TESSERA_KEY_PREFIX": uid,
            "TESSERA_TELEMETRY_INTERVAL_S": str(INTERVAL_S),
            "TESSERA_SCHEDULER_HTTP_PORT": str(self.port),
            "TESSERA_SCHEDULER_CHECKPOINT_INTERVAL_S": "1",
        }
        self.processes: list[ServiceProcess] = []
        self.scheduler: ServiceProcess | None = None

    def fleet(self, name: str, spec: dict[str, Any], **extra: str) -> ServiceProcess:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"prefix": f"{self.uid}{name}", **spec}))
        env = {**self.env, "TESSERA_TELEMETRY_FLEET": str(path), **extra}
        process = ServiceProcess("telemetry", env)
        self.processes.append(process.start())
        return process

    def start_scorer(self) -> None:
        self.processes.append(ServiceProcess("scorer", self.env).start())

    def start_scheduler(self, **extra: str) -> ServiceProcess:
        register_sync(self.env["TESSERA_REDIS_URL"], self.uid, shipped_card())
        self.scheduler = ServiceProcess("scheduler", {**self.env, **extra}).start()
        self.processes.append(self.scheduler)
        return self.scheduler

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_scored(self, redis: Redis, count: int) -> None:
        keys = Keys(self.uid)
        for _ in range(200):
            if await redis.zcard(keys.rank("total")) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("devices were not scored in time")

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture
def cluster(
    nats_server: NatsServer, redis_server: RedisServer, uid: str, tmp_path: Path
) -> Iterator[Cluster]:
    running = Cluster(nats_server, redis_server, uid, tmp_path)
    running.start_scorer()
    yield running
    running.stop()


async def collected(nc: NatsClient, channel: Any) -> list[Any]:
    """Every message of ``channel`` from now on, as it arrives."""
    into: list[Any] = []

    async def collect(message: Any, msg: Msg) -> None:
        into.append(message)

    await subscribe(nc, channel, collect)
    return into


async def decisions_of(nc: NatsClient, into: list[Any]) -> None:
    async def collect(decision: Any, msg: Msg) -> None:
        into.append(decision)

    await subscribe(nc, PLACEMENT_DECISION, collect)


async def test_a_deployment_lands_where_the_core_would_choose(
    cluster: Cluster, redis: Redis
) -> None:
    cluster.fleet("a", {"seed": 4, "devices": {"laptop": 2, "phone": 2, "workstation": 1}})
    await cluster.wait_scored(redis, 5)
    cluster.start_scheduler()
    view = ClusterView(redis, Keys(cluster.uid))
    await view.load()
    expected = choose(previews(card_spec(shipped_card(), "ring", 1), view.devices({}, {}), 2048, 8))
    async with httpx.AsyncClient(base_url=cluster.api) as client:
        shown = (await client.get("/instance/previews", params={"model": SMOL})).json()
        assert next(p["devices"] for p in shown if p["feasible"]) == list(expected.devices[:1])
        assert all(p["predicted"] is None for p in shown)  # no llama.cpp worker: not predicted
        response = await client.post("/placements", json={"model": SMOL, "deployment_id": "d1"})
        assert response.status_code == 201
        placed = [a["device_id"] for a in response.json()["assignments"]]
        assert placed == list(expected.devices)
        assert (await client.post("/placements", json={"model": "nope"})).status_code == 404
        listed = (await client.get("/placements")).json()
        assert [d["deployment_id"] for d in listed] == ["d1"]
        assert (await client.delete("/placements/d1")).status_code == 204
        assert (await client.delete("/placements/d1")).status_code == 404
        assert (await client.put("/policy", json={"policy": "teleport"})).status_code == 422
        assert (await client.put("/mode", json={"mode": "fastest"})).status_code == 422


async def test_100_requests_in_one_cycle_spread_over_the_devices_that_finish_first(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    cluster.fleet(
        "a",
        {
            "seed": 5,
            "devices": {"watch": 2, "phone": 4, "laptop": 3, "workstation": 2, "edge_server": 1},
        },
    )
    await cluster.wait_scored(redis, 12)
    cluster.start_scheduler(TESSERA_SCHEDULER_CYCLE_MS="500")
    got: list[Any] = []
    await decisions_of(nc, got)
    efficient = Demand(compute=0.05, memory=0.1, efficiency=1.0, network=0.1, stability=0.3)
    heavy = Demand(compute=1.0, memory=0.6, efficiency=0.0, network=0.5, stability=0.3)
    # Align with the cycle: a probe's decision ends one cycle; the burst lands in the next.
    probe = InferenceRequest(
        request_id=f"{cluster.uid}probe", model="tiny-model", prompt_tokens=1, max_tokens=1
    )
    await nc.request(
        PLACEMENT_REQUEST.subject(),
        PLACEMENT_REQUEST.encode(PlacementRequest(task=probe, ts=0.0)),
        timeout=5,
    )
    for i in range(100):
        request = InferenceRequest(
            request_id=f"{cluster.uid}r{i}",
            model="tiny-model",
            prompt_tokens=10,
            max_tokens=8,
            demand=efficient if i % 2 else heavy,
        )
        await nc.publish(
            PLACEMENT_REQUEST.subject(),
            PLACEMENT_REQUEST.encode(PlacementRequest(task=request, ts=0.0)),
        )
    burst = lambda: [d for d in got if not d.task_id.endswith("probe")]  # noqa: E731
    await wait_until(lambda: len(burst()) >= 100, timeout_s=10)
    got[:] = burst()
    assert all(d.placed for d in got), Counter(d.reason for d in got if not d.placed)
    assert len({d.ts for d in got}) < len(got) / 10  # decided together, many in each cycle
    devices = Counter(d.assignments[0].device_id for d in got)
    assert len(devices) >= 4 and max(devices.values()) <= 50
    # Time first: no request waits on a watch or a phone while faster devices have room
    # (which of similar devices a request gets, fit decides: tests/unit/core/test_plugins.py).
    kinds = Counter(d.assignments[0].device_id.split("-")[1] for d in got)
    assert kinds["watch"] == kinds["phone"] == 0, kinds


async def test_a_silent_device_has_its_shards_moved_and_the_deployment_keeps_serving(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    cluster.fleet("a", {"seed": 6, "devices": {"laptop": 2, "workstation": 1}})
    big = cluster.fleet("b", {"seed": 7, "devices": {"cloud_gpu": 1}})  # the obvious host
    await cluster.wait_scored(redis, 4)
    cluster.start_scheduler()
    got: list[Any] = []
    failures: list[Any] = []
    loads: list[Any] = []
    await decisions_of(nc, got)

    async def on_failed(event: Any, msg: Msg) -> None:
        failures.append(event)

    async def on_shard(task: Any, msg: Msg) -> None:
        loads.append(task)

    await subscribe(nc, DEVICE_FAILED, on_failed)
    await subscribe(nc, SHARD_TASK, on_shard)
    async with httpx.AsyncClient(base_url=cluster.api) as client:
        first = (
            await client.post("/placements", json={"model": SMOL, "deployment_id": "d"})
        ).json()
        host = first["assignments"][0]["device_id"]
        assert host == f"{cluster.uid}b-cloudgpu-0"
        big.kill()
        await wait_until(lambda: any(d.task_id == "d" and d.epoch == 2 for d in got), 60)
        moved = next(d for d in got if d.task_id == "d" and d.epoch == 2)
        assert host not in {a.device_id for a in moved.assignments}
        [failure] = [f for f in failures if f.device_id == host]
        # Moved because it failed (how fast is bench/chaos.py's to measure, not a test's).
        assert moved.ts >= failure.ts
        await wait_until(lambda: any(t.epoch == 2 and t.action == "load" for t in loads), 30)
        listed = (await client.get("/placements")).json()
        assert listed[0]["epoch"] == 2 and listed[0]["assignments"][0]["device_id"] != host


async def test_a_device_started_again_before_it_is_missed_gets_its_shard_tasks_again(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    """A worker started again by its supervisor (sooner than 3 missed heartbeats) holds no
    shard: its new announce makes the scheduler send its plan's tasks again, same epoch."""
    cluster.fleet("a", {"seed": 6, "devices": {"laptop": 2}})
    slow = {"TESSERA_TELEMETRY_INTERVAL_S": "4"}  # missed only after 12 s
    big = cluster.fleet("b", {"seed": 7, "devices": {"cloud_gpu": 1}}, **slow)
    await cluster.wait_scored(redis, 3)
    cluster.start_scheduler()
    got = await collected(nc, PLACEMENT_DECISION)
    loads = await collected(nc, SHARD_TASK)
    async with httpx.AsyncClient(base_url=cluster.api) as client:
        first = (
            await client.post("/placements", json={"model": SMOL, "deployment_id": "d"})
        ).json()
    host = first["assignments"][0]["device_id"]
    assert host == f"{cluster.uid}b-cloudgpu-0"

    def loads_to_host() -> int:
        return sum(t.device_id == host and t.action == "load" and t.epoch == 1 for t in loads)

    await wait_until(lambda: loads_to_host() == 1, 30)
    big.kill()
    cluster.processes.remove(big)
    cluster.fleet("b", {"seed": 7, "devices": {"cloud_gpu": 1}}, **slow)
    await wait_until(lambda: loads_to_host() == 2, 30)
    assert not [d for d in got if d.task_id == "d" and d.epoch > 1]  # not re-planned


async def test_a_killed_scheduler_restores_deployments_and_mode_and_skips_a_corrupt_checkpoint(
    cluster: Cluster, redis: Redis
) -> None:
    cluster.fleet("a", {"seed": 8, "devices": {"laptop": 2, "workstation": 2}})
    await cluster.wait_scored(redis, 4)
    scheduler = cluster.start_scheduler()
    async with httpx.AsyncClient(base_url=cluster.api) as client:
        for name in ("d1", "d2"):
            assert (
                await client.post("/placements", json={"model": SMOL, "deployment_id": name})
            ).status_code == 201
        assert (await client.put("/mode", json={"mode": "energy"})).json()["mode"] == "energy"
        before = (await client.get("/placements")).json()

        async def checkpointed() -> bool:  # a periodic checkpoint holds both, in energy mode
            newest = await redis.lindex(f"{cluster.uid}:checkpoints", 0)
            saved = json.loads(newest) if newest else {}
            return saved.get("mode") == "energy" and len(saved.get("deployments", [])) == 2

        await wait_until_async(checkpointed, timeout_s=30)
        scheduler.kill()
        scheduler.start()
        assert (await client.get("/placements")).json() == before  # same, no duplicates
        assert (await client.get("/mode")).json()["mode"] == "energy"
        # A corrupt newest checkpoint: the previous one is used, and it is reported.
        await redis.lpush(f"{cluster.uid}:checkpoints", b'{"schema_version": 1, "ts": "garbage"')
        scheduler.kill()
        scheduler.start()
        assert (await client.get("/placements")).json() == before
        assert any(e.get("msg") == "corrupt checkpoint skipped" for e in scheduler.lines)


async def test_mode_switches_to_energy_when_the_fleets_efficiency_drops_20_percent(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    changes: list[Any] = []

    async def on_mode(change: Any, msg: Msg) -> None:
        changes.append(change)

    await subscribe(nc, MODE_CHANGE, on_mode)
    cluster.fleet(
        "a",
        {
            "seed": 9,
            "background_load": 0.8,
            "devices": {"laptop": 3, "phone": 3},
            "faults": [{"device": "*", "kind": "power_surge", "at_s": 8, "amount": 0.25}],
        },
    )
    await cluster.wait_scored(redis, 6)
    scheduler = cluster.start_scheduler(
        TESSERA_SCHEDULER_MODE_EVAL_S="0.5", TESSERA_SCHEDULER_MODE_DWELL_S="0"
    )
    try:
        await wait_until(lambda: bool(changes), timeout_s=15)
    except AssertionError:
        raise AssertionError(scheduler.lines[-10:]) from None
    [change] = changes
    assert change.mode == "energy" and not change.manual, changes
    # Devices report the surge at different moments within an interval: the switch fires as
    # soon as the cluster's drop crosses 15 %, on the way to the full 20 %.
    dropped = int(change.reason.removeprefix("efficiency dropped ").removesuffix("%"))
    assert 15 <= dropped <= 20
    assert await redis.get(Keys(cluster.uid).mode) == "energy"


async def test_request_reply_callers_get_their_decision(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    cluster.fleet("a", {"seed": 11, "devices": {"laptop": 2}})
    await cluster.wait_scored(redis, 2)
    cluster.start_scheduler()
    request = PlacementRequest(
        task=InferenceRequest(
            request_id=f"{cluster.uid}q", model=SMOL, prompt_tokens=5, max_tokens=4
        ),
        ts=0.0,
    )
    reply = await nc.request(
        PLACEMENT_REQUEST.subject(), PLACEMENT_REQUEST.encode(request), timeout=5
    )
    decision = PLACEMENT_DECISION.decode(reply.data)
    assert decision.task_id == f"{cluster.uid}q" and decision.placed
    assert decision.assignments[0].device_id.startswith(f"{cluster.uid}a-laptop-")


async def test_requests_go_to_the_replica_that_finishes_first_and_spread_under_load(
    cluster: Cluster, redis: Redis, nc: NatsClient
) -> None:
    cluster.fleet("r", {"seed": 3, "devices": {"workstation": 1, "laptop": 1}})
    await cluster.wait_scored(redis, 2)
    cluster.start_scheduler()
    async with httpx.AsyncClient(base_url=cluster.api) as client:
        body = {"model": SMOL, "deployment_id": "smol", "replicas": 2}
        assert (await client.post("/placements", json=body)).status_code == 201
        listed = {d["deployment_id"]: d for d in (await client.get("/placements")).json()}
    assert set(listed) == {"smol", "smol-r2"}
    on = {r: listed[r]["assignments"][0]["device_id"] for r in listed}
    fast = next(d for d in on.values() if "workstation" in d)
    assert set(on.values()) == {fast, next(d for d in on.values() if "laptop" in d)}

    async def route(i: int, max_tokens: int) -> str:
        request = InferenceRequest(
            request_id=f"{cluster.uid}q{i}", model="smol", prompt_tokens=16, max_tokens=max_tokens
        )
        reply = await nc.request(
            PLACEMENT_REQUEST.subject(),
            PLACEMENT_REQUEST.encode(PlacementRequest(task=request, ts=0.0)),
            timeout=5,
        )
        decision = PLACEMENT_DECISION.decode(reply.data)
        assert decision.placed and decision.deployment_id in on, decision
        return on[decision.deployment_id]

    # One short request at a time: each has ended before the next, so the earliest
    # completion is always on the faster device.
    light = [await route(i, max_tokens=1) for i in range(5)]
    assert light == [fast] * 5
    # Forty long requests at once: the fast replica's queue grows until the slow one would
    # finish a request sooner, and it takes some; the fast one still takes more.
    heavy = Counter(await asyncio.gather(*(route(100 + i, 512) for i in range(40))))
    assert heavy[fast] > 40 - heavy[fast] > 0, heavy
