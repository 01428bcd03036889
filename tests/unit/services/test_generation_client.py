"""The gateway's generation client on the in-memory bus, against stand-in first shards: one
complete stream in order whatever arrives twice, and a stream that follows its deployment to a
new placement and continues after the tokens already streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from libs.contracts import (
    DEPLOYMENT_STATUS,
    DEVICE_FAILED,
    GENERATION,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    TOKENS,
    Assignment,
    DeploymentStatus,
    DeviceFailed,
    GenerationRequest,
    InferenceRequest,
    Mode,
    PlacementDecision,
    PlacementRequest,
    Sampling,
    ShardProgress,
    TokenChunk,
)
from libs.runtime.memory_bus import MemoryBus, MemoryDelivery
from services.gateway.core.deployed import Route, RouteBook
from services.gateway.core.generation import GenerationClient
from tests.waiting import wait_until

#: What the model would answer, whole.
ANSWER = [101, 102, 103, 104, 105, 106]


class Shard:
    """A first shard that takes requests on its subject, acknowledges them and streams
    ``ANSWER`` after what the request says was already generated, up to ``stop_after``."""

    def __init__(self, bus: MemoryBus, device_id: str, stop_after: int | None = None) -> None:
        self.bus, self.device_id, self.stop_after = bus, device_id, stop_after
        self.requests: list[GenerationRequest] = []

    async def on_request(self, request: GenerationRequest, delivery: MemoryDelivery) -> None:
        self.requests.append(request)
        self.bus.answer(delivery)
        start = len(request.generated_token_ids)
        end = len(ANSWER) if self.stop_after is None else self.stop_after
        for index in range(start, end):
            chunk = self.chunk(request, index, token_id=ANSWER[index])
            await self.bus.publish(
                TOKENS, chunk, request_id=request.request_id, device_id=self.device_id
            )
            if index == start:  # a repeat on the way, as after a reconnect
                await self.bus.publish(
                    TOKENS, chunk, request_id=request.request_id, device_id=self.device_id
                )
        if end == len(ANSWER):
            done = self.chunk(
                request, end, finished=True, finish_reason="stop", completion_tokens=end
            )
            await self.bus.publish(
                TOKENS, done, request_id=request.request_id, device_id=self.device_id
            )

    def chunk(self, request: GenerationRequest, index: int, **fields: Any) -> TokenChunk:
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            epoch=request.epoch,
            device_id=self.device_id,
            ts=time.time(),
            **fields,
        )

    async def serve(self, deployment_id: str) -> None:
        subject = GENERATION.subject(deployment_id=deployment_id, device_id=self.device_id)
        await self.bus.subscribe(GENERATION, self.on_request, subject=subject)


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus()
    yield bus
    await bus.close()


async def collect(client: GenerationClient, request_id: str) -> list[TokenChunk]:
    prompt, sampling = [1, 2, 3], Sampling(max_tokens=len(ANSWER))
    return [c async for c in client.stream("smol", request_id, prompt, sampling)]


async def test_a_stream_is_whole_and_in_order_whatever_arrives_twice(bus: MemoryBus) -> None:
    routes = RouteBook()
    routes.set(Route("smol", 1, ("dev-a", "dev-b")))
    await Shard(bus, "dev-a").serve("smol")
    client = GenerationClient(bus, routes, place_s=0.05)  # no scheduler here: the known route
    chunks = await collect(client, "r1")
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"


async def test_a_stream_follows_its_deployment_and_continues_after_what_it_had(
    bus: MemoryBus,
) -> None:
    routes = RouteBook()
    await routes.watch(bus)
    routes.set(Route("smol", 1, ("dev-a",)))
    first, second = Shard(bus, "dev-a", stop_after=2), Shard(bus, "dev-c")
    await first.serve("smol")
    await second.serve("smol")
    client = GenerationClient(bus, routes, place_s=0.05, move_s=0.2)
    stream = client.stream("smol", "r2", [1, 2, 3], Sampling(max_tokens=len(ANSWER)))
    got = [await anext(stream), await anext(stream)]  # dev-a streams two tokens, then dies

    async def rest() -> list[TokenChunk]:
        return [chunk async for chunk in stream]

    following = asyncio.create_task(rest())  # the stream goes on meanwhile
    failed = DeviceFailed(device_id="dev-a", ts=time.time(), last_seen_ts=0.0, missed_heartbeats=3)
    await bus.publish(DEVICE_FAILED, failed, device_id="dev-a")
    # The scheduler re-placed it on dev-c, whose worker takes longer than ``move_s`` to load
    # it: the stream waits for the new plan rather than fail.
    loading = DeploymentStatus(
        deployment_id="smol",
        model="smollm2-135m-instruct",
        phase="loading",
        epoch=2,
        progress=0.5,
        shards=(ShardProgress(device_id="dev-c", shard_index=0, state="loading", progress=0.5),),
        ts=time.time(),
    )
    await bus.publish(DEPLOYMENT_STATUS, loading, deployment_id="smol")
    await asyncio.sleep(0.5)  # the load's duration, longer than move_s
    # Loaded: it serves at epoch 2.
    moved = DeploymentStatus(
        deployment_id="smol",
        model="smollm2-135m-instruct",
        phase="serving",
        epoch=2,
        progress=1.0,
        shards=(ShardProgress(device_id="dev-c", shard_index=0, state="loaded", progress=1.0),),
        ts=time.time(),
    )
    await bus.publish(DEPLOYMENT_STATUS, moved, deployment_id="smol")
    got += await following
    assert [c.token_id for c in got if c.token_id is not None] == ANSWER  # no hole, no repeat
    assert got[-1].finished and got[-1].finish_reason == "stop" and got[-1].epoch == 2
    [resumed] = second.requests
    assert resumed.epoch == 2 and list(resumed.generated_token_ids) == ANSWER[:2]


async def test_a_stream_goes_to_the_replica_the_scheduler_chose(bus: MemoryBus) -> None:
    routes = RouteBook()
    routes.set(Route("smol", 1, ("dev-a",)))
    routes.set(Route("smol-r2", 1, ("dev-b",)))
    base, replica = Shard(bus, "dev-a"), Shard(bus, "dev-b")
    await base.serve("smol")
    await replica.serve("smol-r2")

    async def scheduler(request: PlacementRequest, delivery: MemoryDelivery) -> None:
        decision = PlacementDecision(
            task_id=request.task.request_id,  # type: ignore[union-attr]
            kind="inference",
            placed=True,
            assignments=(Assignment(device_id="dev-b"),),
            policy="dwps",
            mode=Mode.BALANCED,
            epoch=1,
            ts=time.time(),
            deployment_id="smol-r2",
        )
        await bus.reply(delivery.reply, PLACEMENT_DECISION, decision)

    await bus.subscribe(PLACEMENT_REQUEST, scheduler)
    chunks = await collect(GenerationClient(bus, routes, place_s=1.0), "r3")
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    assert [r.request_id for r in replica.requests] == ["r3"] and base.requests == []
    assert [r.deployment_id for r in replica.requests] == ["smol-r2"]


async def test_a_request_waits_while_its_deployment_loads_and_runs_once_it_serves(
    bus: MemoryBus,
) -> None:
    """The scheduler routes only to copies that serve: a request that arrives while its
    deployment loads (after a move) waits for the status saying it serves, then runs there;
    one whose deployment was refused fails at once with the reason."""
    routes = RouteBook()
    await routes.watch(bus)
    shard = Shard(bus, "dev-c")
    await shard.serve("smol")
    serving = False
    asked: list[str] = []

    async def scheduler(request: PlacementRequest, delivery: MemoryDelivery) -> None:
        task = request.task
        assert isinstance(task, InferenceRequest)
        asked.append(task.request_id)
        placed = serving or task.model == "gone"
        refused = task.model == "gone"
        decision = PlacementDecision(
            task_id=task.request_id,
            kind="inference",
            placed=placed and not refused,
            assignments=(Assignment(device_id="dev-c"),) if placed and not refused else (),
            reason=None
            if placed and not refused
            else "not_serving: gone refused (0%): dev-x refused: no weights"
            if refused
            else "not_serving: smol loading (50%)",
            policy="dwps",
            mode=Mode.BALANCED,
            epoch=2,
            ts=time.time(),
            deployment_id="smol" if placed and not refused else None,
        )
        await bus.reply(delivery.reply, PLACEMENT_DECISION, decision)

    await bus.subscribe(PLACEMENT_REQUEST, scheduler)
    client = GenerationClient(bus, routes, place_s=1.0)
    stream = asyncio.create_task(collect(client, "r4"))
    await wait_until(lambda: len(asked) >= 1, 5)
    assert not stream.done() and shard.requests == []  # waiting, not sent anywhere
    serving = True
    now_serving = DeploymentStatus(
        deployment_id="smol",
        model="smollm2-135m-instruct",
        phase="serving",
        epoch=2,
        progress=1.0,
        shards=(ShardProgress(device_id="dev-c", shard_index=0, state="loaded", progress=1.0),),
        ts=time.time(),
    )
    await bus.publish(DEPLOYMENT_STATUS, now_serving, deployment_id="smol")
    chunks = await stream
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    [refused] = [c async for c in client.stream("gone", "r5", [1], Sampling(max_tokens=2))]
    assert refused.finish_reason == "error" and "no weights" in (refused.error or "")
