"""``edgeflow`` on the gateway's batch runner, with the cluster's Redis (a real server): a batch
the cloud declines runs on the model's edge copy, the one EdgeFlow's edge admission picks, and
every request of it goes there; a batch the cloud takes stays on the model's own deployment;
with the edge busy, a third is declined saying so. Every custom id is answered once, and an
answer names the model the user asked for, not the copy.

The gateway's serving path is stood in for by ``Gateway`` below (it answers at once and
records which deployment each request named): routing through the real one, with workers, is
what ``bench/jobs_live.py --policies edgeflow`` runs on a live cluster."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis.asyncio import Redis

from services.gateway.batches.lines import read_lines
from services.gateway.batches.routes import BatchCreate, admitted
from services.gateway.batches.runner import BatchRunner
from services.gateway.batches.store import JobStore
from services.gateway.core.errors import ApiError
from tests.waiting import wait_until_async

MODEL = "smollm2-135m-instruct"
EDGE = "smollm2-edge"
TOKENS = 10


class Gateway:
    """A stand-in for the gateway's serving path: answers each request with ``TOKENS`` tokens
    and notes the deployment it named; the model's own copy answers from worker-0, the edge
    copy from worker-1."""

    def __init__(self) -> None:
        self.named: dict[str, list[str]] = {}
        self.in_flight = self.most_in_flight = 0

    async def __call__(
        self, endpoint: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], list[str]]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.2)  # long beside a step: the first step's requests overlap
        self.in_flight -= 1
        text = body["messages"][0]["content"]
        self.named.setdefault(text, []).append(body["model"])
        answer = {
            "id": f"chatcmpl-{text}",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 13},
        }
        return 200, answer, ["worker-1" if body["model"] == EDGE else "worker-0"]


async def submit(runner: BatchRunner, name: str, count: int, window_s: float) -> dict[str, Any]:
    lines = [
        {"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "max_tokens": TOKENS,
                  "messages": [{"role": "user", "content": f"{name}-{i}"}]}}
        for i in range(count)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = await runner.store.add_file(content, f"{name}.jsonl", "batch")
    body = BatchCreate(
        input_file_id=file["id"], endpoint="/v1/chat/completions", completion_window="1h"
    )
    parsed = read_lines(content, body.endpoint)
    async with runner.admitting:
        return await admitted(runner, body, parsed, MODEL, window_s)


async def test_a_batch_the_cloud_declines_runs_on_the_edge_copy(redis: Redis, uid: str) -> None:
    store, gateway = JobStore(redis, uid), Gateway()
    # Two streams for the cloud, two for each edge copy, four in all.
    runner = BatchRunner(
        store, gateway, 2, policy="edgeflow", lanes=lambda m: [EDGE] if m == MODEL else [], most=4
    )
    # Measured curves (tokens/s by requests at once): both copies alike. 8 requests of 10
    # tokens take 2 s at 2 at once, 4 s at 1.
    for key in (MODEL, EDGE):
        await store.set_rate(key, 1, 20.0)
        await store.set_rate(key, 2, 40.0)
    first = await submit(runner, "a", 8, 3.0)  # needs both streams of the cloud until 2 s
    assert first["edge_deployment"] is None and "admitted (edgeflow)" in first["decision"]
    second = await submit(runner, "b", 8, 3.0)  # after "a" it would end at 4 s: the edge
    assert second["edge_deployment"] == EDGE
    assert f"on the edge, deployment {EDGE}" in second["decision"]
    with pytest.raises(ApiError) as declined:  # the edge runs "b": nothing left for "c"
        await submit(runner, "c", 8, 3.0)
    assert "no edge deployment of it is free" in declined.value.message

    running = asyncio.create_task(runner.run())
    try:

        async def ended() -> bool:
            batches = [await store.batch(b["id"]) for b in (first, second)]
            return all(b is not None and b["status"] == "completed" for b in batches)

        await wait_until_async(ended, timeout_s=30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await runner.close()
    assert gateway.most_in_flight == 4  # the edge copy's streams beside the cloud's
    for batch, where, device in ((first, MODEL, "worker-0"), (second, EDGE, "worker-1")):
        done = await store.batch(batch["id"])
        assert done is not None and done["devices"] == [device]
        rows = [
            json.loads(r) for r in (await store.content(done["output_file_id"]) or b"").splitlines()
        ]
        prefix = "a" if batch is first else "b"
        assert sorted(r["custom_id"] for r in rows) == sorted(f"{prefix}-{i}" for i in range(8))
        assert all(r["response"]["body"]["model"] == MODEL for r in rows)  # the user's name
        for i in range(8):
            assert gateway.named[f"{prefix}-{i}"] == [where]  # sent once, to that copy


async def test_a_batch_whose_edge_copy_stops_serving_ends_on_the_cloud(
    redis: Redis, uid: str
) -> None:
    """The edge copy is undeployed after its first answers: what is left of the batch runs on
    the model's own deployment, and no request is answered with the copy's 404."""
    store, gateway = JobStore(redis, uid), Gateway()
    serving = {EDGE: True}

    async def edge_then_gone(
        endpoint: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], list[str]]:
        if body["model"] == EDGE and len(gateway.named) >= 3:
            serving[EDGE] = False
        if body["model"] == EDGE and not serving[EDGE]:
            return 404, {"error": {"message": f"model {EDGE!r} is not deployed"}}, []
        return await gateway(endpoint, body)

    runner = BatchRunner(
        store, edge_then_gone, 2, policy="edgeflow",
        lanes=lambda m: [EDGE] if m == MODEL and serving[EDGE] else [], most=4,
    )  # fmt: skip
    for key in (MODEL, EDGE):
        await store.set_rate(key, 1, 20.0)
        await store.set_rate(key, 2, 40.0)
    await submit(runner, "a", 8, 3.0)
    second = await submit(runner, "b", 8, 30.0)  # admitted on the edge: the cloud is "a"'s
    assert second["edge_deployment"] == EDGE
    running = asyncio.create_task(runner.run())
    try:

        async def ended() -> bool:
            done = await store.batch(second["id"])
            return done is not None and done["status"] == "completed"

        await wait_until_async(ended, timeout_s=30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await runner.close()
    done = await store.batch(second["id"])
    assert done is not None and done["edge_deployment"] is None  # the cloud took it back
    assert done["error_file_id"] is None and done["request_counts"]["completed"] == 8
    # The edge copy answered the first of them, the model's own deployment the rest.
    assert done["devices"] == ["worker-0", "worker-1"]


async def run_on_a_slowed_cloud(
    redis: Redis, uid: str, policy: str
) -> tuple[dict[str, Any], dict[str, Any], list[list[str]]]:
    """A batch admitted on the cloud at the rate measured before, which then finds the cloud
    ten times slower (each request there takes 2 s): the batch as admitted, as it ended, and
    where each request was sent."""
    store, gateway = JobStore(redis, f"{uid}-{policy}"), Gateway()

    async def slow_cloud(
        endpoint: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], list[str]]:
        if body["model"] == MODEL:
            await asyncio.sleep(1.8)
        return await gateway(endpoint, body)

    runner = BatchRunner(
        store, slow_cloud, 2, policy=policy, lanes=lambda m: [EDGE] if m == MODEL else [],
        most=4,
    )  # fmt: skip
    for key in (MODEL, EDGE):
        await store.set_rate(key, 1, 20.0)
        await store.set_rate(key, 2, 40.0)
    batch = await submit(runner, "a", 8, 6.0)  # 2 s at the rate measured before: the cloud
    assert batch["edge_deployment"] is None
    running = asyncio.create_task(runner.run())
    try:

        async def ended() -> bool:
            done = await store.batch(batch["id"])
            return done is not None and done["status"] in ("completed", "expired")

        await wait_until_async(ended, timeout_s=30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await runner.close()
    done = await store.batch(batch["id"])
    assert done is not None
    return batch, done, [gateway.named.get(f"a-{i}", []) for i in range(8)]


async def test_a_batch_the_cloud_now_misses_moves_to_the_idle_edge_copy_and_ends_in_time(
    redis: Redis, uid: str
) -> None:
    """Once the slower cloud is measured, EdgeFlow's plan misses the deadline and the rest of
    the batch runs on the idle edge copy, in time; ElasticFlow's policy, with no edge, lets it
    expire (the same batch, the same stand-in)."""
    batch, done, sent = await run_on_a_slowed_cloud(redis, uid, "edgeflow")
    assert done["status"] == "completed" and done["completed_at"] <= batch["expires_at"], done
    assert done["edge_deployment"] == EDGE and "the cloud's plan missed" in done["decision"]
    assert all(len(where) == 1 for where in sent)  # each sent once
    assert sent.count([MODEL]) >= 2 and sent.count([EDGE]) >= 2, sent  # then the edge
    _, alone, _ = await run_on_a_slowed_cloud(redis, uid, "elasticflow")
    assert alone["status"] == "expired" and alone["request_counts"]["failed"] >= 1
