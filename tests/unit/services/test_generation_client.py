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
    DEPLOYMENT_EVENT,
    DEPLOYMENTS_SNAPSHOT,
    DEVICE_FAILED,
    GENERATION,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    TOKENS,
    Assignment,
    DeploymentChange,
    DeploymentPlanned,
    DeploymentState,
    DeviceFailed,
    GenerationRequest,
    InferenceRequest,
    Mode,
    PlacementDecision,
    PlacementRequest,
    Sampling,
    ShardProgress,
    ShardReported,
    TokenChunk,
    shard_ring,
)
from libs.deployments import DeploymentBook, phases, record
from libs.runtime.memory_bus import MemoryBus
from libs.runtime.memory_subscriptions import MemoryDelivery
from services.gateway.core.deployed import Deployed, hand_placed
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


def placed(name: str, epoch: int, *devices: str) -> DeploymentState:
    """``name`` serving on ``devices`` (an even split of 30 layers) at ``epoch``."""
    step = 30 // len(devices)
    ring = [(d, i * step, (i + 1) * step) for i, d in enumerate(devices)]
    return hand_placed(shard_ring("load", name, "smollm2-135m-instruct", ring, epoch, 0.0))


class Writer:
    """The scheduler's side of the deployment book, played by the test: a snapshot first
    (what a leader publishes when it starts), then each change as the next event."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus, self.book = bus, DeploymentBook(term="test")

    async def start(self, *deployments: DeploymentState) -> None:
        self.book = DeploymentBook.holding(deployments, term="test")
        await self.bus.publish(DEPLOYMENTS_SNAPSHOT, self.book.snapshot(time.time()))

    async def change(self, *changes: DeploymentChange) -> None:
        self.book, events = record(self.book, changes, time.time())
        for event in events:
            await self.bus.publish(DEPLOYMENT_EVENT, event, deployment_id="smol")
        await self.bus.settle()


def replanned(name: str, epoch: int, device: str) -> DeploymentPlanned:
    """``name`` planned again on ``device`` at ``epoch``: pending until its worker reports."""
    return DeploymentPlanned(deployment=phases.planned(placed(name, epoch, device), ()))


def reported(name: str, epoch: int, device: str, state: str, progress: float) -> ShardReported:
    shard = ShardProgress(device_id=device, shard_index=0, state=state, progress=progress)  # type: ignore[arg-type]
    return ShardReported(deployment_id=name, epoch=epoch, shard=shard)


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus()
    yield bus
    await bus.close()


async def collect(client: GenerationClient, request_id: str) -> list[TokenChunk]:
    prompt, sampling = [1, 2, 3], Sampling(max_tokens=len(ANSWER))
    return [c async for c in client.stream("smol", request_id, prompt, sampling)]


async def test_a_stream_is_whole_and_in_order_whatever_arrives_twice(bus: MemoryBus) -> None:
    routes = Deployed()
    routes.hold(placed("smol", 1, "dev-a", "dev-b"))
    await Shard(bus, "dev-a").serve("smol")
    client = GenerationClient(bus, routes, place_s=0.05)  # no scheduler here: the known route
    chunks = await collect(client, "r1")
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"


async def test_a_stream_follows_its_deployment_and_continues_after_what_it_had(
    bus: MemoryBus,
) -> None:
    routes, writer = Deployed(), Writer(bus)
    await routes.watch(bus)
    await writer.start(placed("smol", 1, "dev-a"))
    await bus.settle()
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
    await writer.change(replanned("smol", 2, "dev-c"), reported("smol", 2, "dev-c", "loading", 0.5))
    await asyncio.sleep(0.5)  # the load's duration, longer than move_s
    # Loaded: it serves at epoch 2.
    await writer.change(reported("smol", 2, "dev-c", "loaded", 1.0))
    got += await following
    assert [c.token_id for c in got if c.token_id is not None] == ANSWER  # no hole, no repeat
    assert got[-1].finished and got[-1].finish_reason == "stop" and got[-1].epoch == 2
    [resumed] = second.requests
    assert resumed.epoch == 2 and list(resumed.generated_token_ids) == ANSWER[:2]


async def test_a_stream_goes_to_the_replica_the_scheduler_chose(bus: MemoryBus) -> None:
    routes = Deployed()
    routes.hold(placed("smol", 1, "dev-a"))
    routes.hold(placed("smol-r2", 1, "dev-b"))
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
    routes, writer = Deployed(), Writer(bus)
    await routes.watch(bus)
    await writer.start(placed("smol", 1, "dev-a"))
    await writer.change(replanned("smol", 2, "dev-c"), reported("smol", 2, "dev-c", "loading", 0.5))
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
    await writer.change(reported("smol", 2, "dev-c", "loaded", 1.0))
    chunks = await stream
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    [refused] = [c async for c in client.stream("gone", "r5", [1], Sampling(max_tokens=2))]
    assert refused.finish_reason == "error" and "no weights" in (refused.error or "")
