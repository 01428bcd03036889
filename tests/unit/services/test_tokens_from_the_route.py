"""The gateway takes a request's token chunks only from a device of its route: a device that
serves nothing of the request and writes chunks for it (its NATS user may publish chunks in
its own name only: tests/integration/test_hostile_device.py) changes nothing in the answer,
and each such chunk is counted as refused."""

from __future__ import annotations

import time

from libs.contracts import TOKENS, GenerationRequest, Sampling, TokenChunk, shard_ring
from libs.runtime.memory_bus import MemoryBus
from libs.runtime.memory_subscriptions import MemoryDelivery
from services.gateway.core.deployed import Deployed, hand_placed
from services.gateway.core.generation import GenerationClient
from tests.unit.services.test_generation_client import ANSWER, Shard
from tests.waiting import wait_until


class Hijacked(Shard):
    """A first shard whose request a hostile device answers first: it streams only once the
    gateway has refused a forged chunk, so the forgery surely came while the stream was open."""

    def __init__(self, bus: MemoryBus, device_id: str, refused: list[str]) -> None:
        super().__init__(bus, device_id)
        self.refused = refused

    async def on_request(self, request: GenerationRequest, delivery: MemoryDelivery) -> None:
        for index in range(len(ANSWER) + 1):
            forged = TokenChunk(
                request_id=request.request_id,
                index=index,
                epoch=request.epoch,
                token_id=666,
                text="forged",
                finished=index == len(ANSWER),
                ts=time.time(),
            )
            await self.bus.publish(TOKENS, forged, request_id=request.request_id, device_id="dev-x")
        await wait_until(lambda: len(self.refused) == len(ANSWER) + 1, 10)
        await super().on_request(request, delivery)


async def test_chunks_from_a_device_outside_the_route_change_nothing() -> None:
    bus = MemoryBus()
    refused: list[str] = []

    def rejected(channel: str, reason: str, detail: str) -> None:
        if reason == "not_routed":
            refused.append(detail)

    routes = Deployed()
    ring = shard_ring("load", "smol", "m", [("dev-a", 0, 15), ("dev-b", 15, 30)], 1, 0.0)
    routes.hold(hand_placed(ring))
    await Hijacked(bus, "dev-a", refused).serve("smol")
    client = GenerationClient(bus, routes, place_s=0.05, rejected=rejected)
    prompt, sampling = [1, 2, 3], Sampling(max_tokens=len(ANSWER))
    chunks = [c async for c in client.stream("smol", "r1", prompt, sampling)]
    assert [c.token_id for c in chunks if c.token_id is not None] == ANSWER
    assert chunks[-1].finish_reason == "stop"
    assert refused == ["a chunk from dev-x"] * (len(ANSWER) + 1)
    await bus.close()
