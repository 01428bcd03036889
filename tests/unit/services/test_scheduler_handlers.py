"""The scheduler's handlers on the in-memory bus and an in-memory Redis (``fakeredis``):
deployments become shard tasks in a ring, requests for a deployed model (once its workers
report it loaded) are routed at once, a failed device's shards move (tests/integration runs
the same on real servers)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest

from libs.contracts import (
    DEPLOYMENT_EVENT,
    DEPLOYMENT_MEASURED,
    DEPLOYMENTS_SNAPSHOT,
    DEVICE_FAILED,
    MODE_CHANGE,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SHARD_STATUS,
    SHARD_TASK,
    Assignment,
    DeploymentMeasured,
    DeploymentState,
    DeviceAnnounce,
    DeviceClass,
    DeviceFailed,
    InferenceRequest,
    Mode,
    ModelDeployment,
    PlacementRequest,
    SchedulerCheckpoint,
    ShardProgress,
    ShardReported,
    ShardStatus,
    ShardTask,
    Speed,
)
from libs.contracts.keys import DeviceField, Keys, scored_fields
from libs.contracts.profiles import DimensionWeights
from libs.core.profiles import BUILTIN_PROFILES
from libs.deployments import DeploymentBook, follow
from libs.models.registry import ModelRegistry
from libs.runtime.memory_bus import MemoryBus
from libs.weights.registration import register_shipped
from services.scheduler.checkpoints import CheckpointStore
from services.scheduler.decisions import plan_decision
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings
from services.scheduler.view import CLASS_SLOTS
from tests.builders import NOW, make_capabilities, make_telemetry
from tests.waiting import wait_until

MODEL = "smollm2-135m-instruct"
DEVICES = ("ws-a", "ws-b", "ws-c")


async def seed(
    redis: Any,
    keys: Keys,
    device_id: str,
    memory_gb: float = 1.0,
    tflops: float = 1.0,
    engine: str = "torch",
    slots: int | None = None,
) -> None:
    """What the scorer would have written for a scored workstation with a worker of
    ``engine`` (a llamacpp one announces its RPC server's address) running ``slots``
    requests at once (None: it announces none)."""
    announce = DeviceAnnounce(
        device_id=device_id,
        device_class=DeviceClass.WORKSTATION,
        capabilities=make_capabilities(memory_total_gb=memory_gb, fp32_tflops=tflops),
        emulated=True,
        interval_s=1.0,
        engines=(engine,),
        rpc_endpoint=f"{device_id}.lan:50052" if engine == "llamacpp" else None,
        slots=slots,
        ts=NOW,
    )
    sample = make_telemetry(
        device_id, memory_total_gb=memory_gb, memory_available_gb=memory_gb * 0.75
    )
    scores = dict.fromkeys(("compute", "memory", "efficiency", "network", "stability"), 0.5)
    row = scored_fields(scores | {"total": 0.5}, DeviceClass.WORKSTATION, NOW, Mode.BALANCED, 1.0)
    await redis.set(keys.caps(device_id), announce.model_dump_json())
    await redis.hset(
        keys.device(device_id), mapping={**row, DeviceField.SAMPLE: sample.model_dump_json()}
    )
    await redis.zadd(keys.rank("total"), {device_id: 0.5})


async def start(
    devices: dict[str, tuple[float, float]],
    engines: dict[str, str] | None = None,
    slots: int | None = None,
    contexts: dict[str, int | None] | None = None,
) -> tuple[Scheduler, MemoryBus]:
    """A scheduler over ``devices`` (id → memory GB, FP32 TFLOP/s; their workers' engines:
    torch unless ``engines`` says, announcing ``slots`` and the longest context in
    ``contexts``) on in-memory servers."""
    bus, redis, keys = MemoryBus(), fakeredis.FakeAsyncRedis(decode_responses=True), Keys("u")
    for device_id, (memory_gb, tflops) in devices.items():
        engine = (engines or {}).get(device_id, "torch")
        await seed(redis, keys, device_id, memory_gb, tflops, engine, slots)
        if contexts is not None:
            announce = DeviceAnnounce.model_validate_json(await redis.get(keys.caps(device_id)))
            update = {"context_length": contexts.get(device_id)}
            await redis.set(
                keys.caps(device_id), announce.model_copy(update=update).model_dump_json()
            )
    settings = SchedulerSettings(key_prefix="u", cycle_ms=100, mode_eval_s=3600)
    await register_shipped(ModelRegistry(redis, "u"))
    checkpoints = CheckpointStore(redis, None, keys, settings.checkpoints_kept)
    service = Scheduler(settings, bus, redis, checkpoints, SchedulerMetrics.create(), lambda: NOW)
    await service.start()
    return service, bus


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[Scheduler, MemoryBus]]:
    service, bus = await start(dict.fromkeys(DEVICES, (0.6, 1.0)))
    yield service, bus
    await service.abandon()
    await bus.close()


async def deploy(bus: MemoryBus) -> Any:
    task = ModelDeployment(deployment_id="smol", model=MODEL, max_shards=3)
    request = PlacementRequest(task=task, ts=NOW)
    return await bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, timeout_s=10)


async def loaded(service: Scheduler, bus: MemoryBus, decision: Any) -> None:
    """Each worker of ``decision``'s plan reports its shard loaded; wait until it serves."""
    for a in decision.assignments:
        status = ShardStatus(
            deployment_id=decision.deployment_id,
            device_id=a.device_id,
            shard_index=a.shard_index,
            epoch=decision.epoch,
            state="loaded",
            ts=NOW,
        )
        await bus.publish(SHARD_STATUS, status, device_id=a.device_id)
    await wait_until(lambda: service.book.by_id[decision.deployment_id].phase == "serving", 10)


def ring_is_whole(tasks: list[ShardTask], layers: int = 30) -> None:
    ordered = sorted(tasks, key=lambda t: t.shard_index)
    assert ordered[0].layer_start == 0 and ordered[-1].layer_end == layers
    for task, after in itertools.pairwise(ordered):
        assert task.layer_end == after.layer_start and task.next_device_id == after.device_id
    assert ordered[-1].next_device_id is None
    assert all(t.route == tuple(o.device_id for o in ordered) for t in ordered)


async def test_a_deployment_is_answered_and_sent_as_a_ring_of_durable_shard_tasks(
    scheduler: Any,
) -> None:
    _, bus = scheduler
    decision = await deploy(bus)
    assert decision.placed and decision.epoch == 1, decision.reason
    assert len(decision.assignments) >= 2  # 0.45 GB free each: the model (0.48 GB) fits on none
    await bus.settle()
    loads = [t for t in bus.sent(SHARD_TASK) if t.action == "load"]
    assert {t.device_id for t in loads} == {a.device_id for a in decision.assignments}
    ring_is_whole(loads)


async def test_a_request_for_a_deployed_model_is_routed_to_its_first_shard(
    scheduler: Any,
) -> None:
    service, bus = scheduler
    deployed = await deploy(bus)
    await loaded(service, bus, deployed)
    request = PlacementRequest(
        task=InferenceRequest(request_id="r1", model=MODEL, prompt_tokens=8, max_tokens=8),
        ts=NOW,
    )
    routed = await bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, timeout_s=10)
    assert routed.placed and routed.kind == "inference" and routed.task_id == "r1"
    assert routed.assignments == deployed.assignments and routed.epoch == deployed.epoch


async def test_a_failed_device_has_its_shards_moved_under_a_new_epoch(scheduler: Any) -> None:
    _, bus = scheduler
    decision = await deploy(bus)
    lost = decision.assignments[0].device_id
    await bus.publish(
        DEVICE_FAILED,
        DeviceFailed(device_id=lost, ts=NOW, last_seen_ts=NOW - 3, missed_heartbeats=3),
        device_id=lost,
    )

    def moved() -> list[ShardTask]:
        return [t for t in bus.sent(SHARD_TASK) if t.epoch == 2 and t.action == "load"]

    await wait_until(lambda: moved(), timeout_s=10)
    await bus.settle()
    assert lost not in {t.device_id for t in moved()}
    ring_is_whole(moved())
    unloads = [t for t in bus.sent(SHARD_TASK) if t.action == "unload"]
    # Every device of epoch 1 drops it, the failed one too (a leaving device waits for this).
    assert {t.epoch for t in unloads} == {1}
    assert {t.device_id for t in unloads} == {a.device_id for a in decision.assignments}
    announced = [d for d in bus.sent(PLACEMENT_DECISION) if d.task_id == "smol"]
    assert announced[-1].epoch == 2


async def test_a_custom_profile_reaches_the_scorer_and_a_scorer_started_later(
    scheduler: Any,
) -> None:
    service, bus = scheduler
    weights = DimensionWeights(compute=0.6, memory=0.1, efficiency=0.1, network=0.1, stability=0.1)
    profile = BUILTIN_PROFILES[Mode.BALANCED].model_copy(
        update={"name": "compute-first", "dimensions": weights}
    )
    await service.modes.set_policy("dwps", profile)
    await bus.settle()
    [change] = bus.sent(MODE_CHANGE)
    assert change.weights == weights and change.mode == Mode.BALANCED
    stored = await service.modes.redis.get(Keys("u").weights)
    assert DimensionWeights.model_validate_json(stored) == weights  # for a scorer that restarts
    await service.modes.set_mode(Mode.ENERGY, "test", manual=True)  # a mode brings its own weights
    assert bus.sent(MODE_CHANGE)[-1].weights is None
    assert await service.modes.redis.get(Keys("u").weights) is None


async def test_each_request_goes_to_the_replica_that_finishes_it_first() -> None:
    # Two workstations that hold the model whole, one four times as fast as the other.
    service, bus = await start({"fast": (4.0, 4.0), "slow": (4.0, 1.0)})
    task = ModelDeployment(deployment_id="smol", model=MODEL, replicas=2)
    deployed = await bus.request(
        PLACEMENT_REQUEST, PlacementRequest(task=task, ts=NOW), PLACEMENT_DECISION, 10
    )
    assert deployed.placed, deployed.reason
    for copy in list(service.book):
        await loaded(service, bus, plan_decision(copy, Mode.BALANCED, NOW))
    replicas = {d.deployment_id: d for d in service.book}
    assert set(replicas) == {"smol", "smol-r2"} and replicas["smol-r2"].replica_of == "smol"
    on = {r: replicas[r].assignments[0].device_id for r in replicas}
    assert set(on.values()) == {"fast", "slow"}  # each replica on a device of its own

    async def route(i: int) -> str:
        request = InferenceRequest(request_id=f"r{i}", model="smol", prompt_tokens=8, max_tokens=64)
        decision = await bus.request(
            PLACEMENT_REQUEST, PlacementRequest(task=request, ts=NOW), PLACEMENT_DECISION, 10
        )
        assert decision.placed and decision.deployment_id in replicas
        assert decision.assignments == replicas[decision.deployment_id].assignments
        return on[decision.deployment_id]

    # The clock stands still, so every request is still running when the next comes. With t
    # a request's time on the fast replica (4t on the slow one), requests 1–4 end at t..4t
    # on the fast one; the 5th would end at 5t there, 4t on the slow one: it goes there.
    # Requests 6–9 end at 5t..8t on the fast one (at 8t both tie: the more capable device
    # wins); the 10th would end at 9t there, 8t on the slow one.
    chosen = [await route(i) for i in range(10)]
    assert chosen == ["fast"] * 4 + ["slow"] + ["fast"] * 4 + ["slow"]
    await service.abandon()
    await bus.close()


async def test_a_deployments_precision_sizes_its_shards_and_reaches_each_worker() -> None:
    """Workstations with 0.75 GB free each: int8 SmolLM2 (1 byte a weight, 0.48 GB) fits on
    one; float32 (4 bytes a weight) needs two; each shard task names the precision."""
    service, bus = await start(dict.fromkeys(DEVICES, (1.0, 1.0)))
    try:
        devices = {}
        for precision in ("int8", "float32"):
            task = ModelDeployment(
                deployment_id=f"smol-{precision}", model=MODEL, max_shards=3, precision=precision
            )
            request = PlacementRequest(task=task, ts=NOW)
            decision = await bus.request(
                PLACEMENT_REQUEST, request, PLACEMENT_DECISION, timeout_s=10
            )
            assert decision.placed, decision.reason
            devices[precision] = len(decision.assignments)
            await service.undeploy(task.deployment_id)  # room for the next
        assert devices == {"int8": 1, "float32": 2}
        await bus.settle()
        loads = [t for t in bus.sent(SHARD_TASK) if t.action == "load"]
        assert {(t.deployment_id, t.precision) for t in loads} == {
            ("smol-int8", "int8"),
            ("smol-float32", "float32"),
        }
    finally:
        await service.abandon()
        await bus.close()


async def test_llamacpp_workers_get_a_split_with_every_devices_rpc_address() -> None:
    """The llamacpp head runs the whole split from its shard task: every shard's layers and
    every device's RPC address, in route order; torch workers' routes carry none, and a split
    never mixes the two (llama.cpp's RPC servers and the torch ring do not talk). Memory is
    sized for a split of 2 in each engine's bytes (0.50 GB a shard for llama.cpp's GGUF with 8
    slots' KV cache, 0.37 at int8 for torch)."""
    mixed = {"ws-a": "llamacpp", "ws-b": "llamacpp", "ws-c": "torch"}
    for engines, has_addresses, memory in (
        (dict.fromkeys(DEVICES, "llamacpp"), True, dict.fromkeys(DEVICES, 0.7)),
        ({}, False, dict.fromkeys(DEVICES, 0.6)),
        (mixed, True, {"ws-a": 0.7, "ws-b": 0.7, "ws-c": 0.6}),
    ):
        service, bus = await start({d: (gb, 1.0) for d, gb in memory.items()}, engines)
        try:
            decision = await deploy(bus)
            assert decision.placed and len(decision.assignments) >= 2, decision.reason
            await bus.settle()
            loads = sorted(
                (t for t in bus.sent(SHARD_TASK) if t.action == "load"),
                key=lambda t: t.shard_index,
            )
            assert len(loads) == len(decision.assignments)
            spans = tuple((t.layer_start, t.layer_end) for t in loads)
            assert all(t.spans == spans for t in loads)
            addresses = tuple(f"{t.device_id}.lan:50052" for t in loads) if has_addresses else ()
            assert all(t.endpoints == addresses for t in loads)
            assert all(t.context_length == 2048 for t in loads)  # llama.cpp's KV per slot
            if engines is mixed:
                assert {t.device_id for t in loads} == {"ws-a", "ws-b"}
        finally:
            await service.abandon()
            await bus.close()


async def test_a_plan_counts_the_request_slots_its_workers_announce() -> None:
    """llama.cpp keeps a KV cache per request slot: SmolLM2's GGUF with 2,048 tokens each
    needs 0.72 GB with the engine's default 8 slots (split over 0.45 GB devices), 0.39 GB
    with the 1 slot these workers announce (one device holds it). A device's announced slots
    are its capacity in the view too (not its class's)."""
    llamacpp = dict.fromkeys(DEVICES, "llamacpp")
    for slots, whole in ((None, False), (1, True)):
        service, bus = await start(dict.fromkeys(DEVICES, (0.6, 1.0)), llamacpp, slots)
        try:
            decision = await deploy(bus)
            assert decision.placed, decision.reason
            assert (len(decision.assignments) == 1) == whole, decision.assignments
            [device] = service.view.devices({}, {}, only={"ws-a"})
            assert device.slots == (slots or CLASS_SLOTS[DeviceClass.WORKSTATION])
        finally:
            await service.abandon()
            await bus.close()


async def test_a_deployment_measured_slower_than_predicted_is_predicted_closer_next() -> None:
    """A llama.cpp deployment is planned with its predicted speed; what the gateway measured is
    recorded beside it (in the book every follower folds), and the next prediction for those
    devices is the measured one; another plan's measurement changes nothing."""
    devices = {"ws-a": (4.0, 1.0), "ws-b": (4.0, 0.5)}
    service, bus = await start(devices, dict.fromkeys(devices, "llamacpp"), slots=1)
    try:
        decision = await deploy(bus)
        assert decision.placed, decision.reason
        await loaded(service, bus, decision)
        state = service.book.by_id["smol"]
        assert state.predicted is not None and state.measured is None
        before = state.predicted.tokens_per_s_1
        assert 0 < before < state.predicted.tokens_per_s_8 and state.predicted.ttft_ms
        slower = Speed(tokens_per_s_1=round(before / 2, 2), ttft_ms=90.0)
        stale = DeploymentMeasured(
            deployment_id="smol", epoch=state.epoch + 1, measured=slower, requests=3
        )
        news = stale.model_copy(update={"epoch": state.epoch})
        for sent in (stale, news):
            await bus.publish(DEPLOYMENT_MEASURED, sent, deployment_id="smol")
        await wait_until(lambda: service.book.by_id["smol"].measured == slower, 10)
        route = [(a.device_id, a.layer_end - a.layer_start) for a in decision.assignments]
        seen = {d.device_id: d for d in service.planner.model_devices(service.book, NOW)}
        again = service.planner.predicted(MODEL, route, seen)
        assert again is not None
        assert again.tokens_per_s_1 == pytest.approx(slower.tokens_per_s_1, rel=0.01)
        folded = DeploymentBook.of(bus.sent(DEPLOYMENTS_SNAPSHOT)[0])
        for event in bus.sent(DEPLOYMENT_EVENT):
            folded, _ = follow(folded, event)
        assert folded.by_id["smol"].measured == slower  # followers see it beside the prediction
        assert not [t for t in bus.sent(SHARD_TASK) if t.action == "unload"]  # nothing moved
        # The correction is the model's on those devices, and a restarted scheduler keeps it.
        saved = service.checkpoint(NOW)
        assert {f"{MODEL}@{d}" for d, _ in route} <= set(saved.factors)
        service.planner.factors = {}
        assert service.planner.predicted(MODEL, route, seen) != again  # forgotten: as before

        async def restore() -> None:
            service.restore(saved)

        await service.loop.call(restore, "restore")
        assert service.planner.predicted(MODEL, route, seen) == again
    finally:
        await service.abandon()
        await bus.close()


async def test_a_restored_checkpoint_is_the_book_every_part_of_the_scheduler_reads(
    scheduler: Any,
) -> None:
    """Restoring replaces the one book: the deployer applies reports to the restored
    deployment and the router routes to it, while the book held before stays as it was
    (the parts used to share one mutable state and were re-pointed at the restored one)."""
    service, bus = scheduler
    before = service.book
    restored = DeploymentState(
        deployment_id="restored",
        model=MODEL,
        epoch=4,
        context_length=2048,
        assignments=(Assignment(device_id="ws-a", layer_end=30, memory_gb=0.5),),
        phase="loading",
        shards=(ShardProgress(device_id="ws-a", shard_index=0, state="loading"),),
    )
    checkpoint = SchedulerCheckpoint(
        ts=NOW,
        mode=Mode.BALANCED,
        policy="dwps",
        weights={},
        deployments=(restored,),
        deployment_index=7,
        counters={"mode_changes": 3, "placed": 5},
    )

    async def restore() -> None:
        service.restore(checkpoint)

    await service.loop.call(restore, "restore")
    assert service.book.index == 7 and "restored" not in before
    kept = service.checkpoint(NOW).counters  # counted on from the checkpoint's
    assert kept["mode_changes"] == 3 and kept["placed"] >= 5
    status = ShardStatus(
        deployment_id="restored", device_id="ws-a", shard_index=0, epoch=4, state="loaded", ts=NOW
    )
    await bus.publish(SHARD_STATUS, status, device_id="ws-a")
    await wait_until(lambda: service.book.by_id["restored"].phase == "serving", 10)
    request = PlacementRequest(
        task=InferenceRequest(request_id="r9", model="restored", prompt_tokens=8, max_tokens=8),
        ts=NOW,
    )
    routed = await bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, timeout_s=10)
    assert routed.placed and routed.deployment_id == "restored"
    await bus.settle()
    [event] = [e for e in bus.sent(DEPLOYMENT_EVENT) if e.index == 8]
    assert event.term == service.book.term and isinstance(event.change, ShardReported)


async def test_every_change_goes_out_as_the_next_numbered_event_a_follower_folds(
    scheduler: Any,
) -> None:
    """A follower that takes the snapshot and then the events holds the scheduler's book."""
    service, bus = scheduler
    deployed = await deploy(bus)
    await loaded(service, bus, deployed)
    await bus.settle()
    [snapshot] = bus.sent(DEPLOYMENTS_SNAPSHOT)
    follower = DeploymentBook.of(snapshot)
    for event in bus.sent(DEPLOYMENT_EVENT):
        follower, said = follow(follower, event)
        assert said == "applied"
    assert follower.by_id == service.book.by_id and follower.index == service.book.index
