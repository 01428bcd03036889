"""The batches' requests run by Celery: the gateway's runner puts each on the broker (as the
``batch-sender`` user of a Redis with the cluster's ACL), a real batch worker process
(``python -m services.batch.worker``, as ``batch``) sends it to the serving path and writes
the answer back. Killed with ``kill -9`` mid-batch, its requests in flight are sent again
through a second worker: every custom id is answered exactly once, none is lost. An
interactive request arriving mid-batch preempts the requests the worker is running (the
gateway cancels them, wherever they came from), and they are sent again after it.

The serving path is stood in for by ``Serving`` (the gateway's own preemption middleware around
an app that answers in ``SERVE_S``): the whole gateway with workers runs the same path in
``tests/e2e/test_batches.py``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from libs.cluster.access import AccessControl
from libs.cluster.servers import RedisServer
from libs.runtime.procs import free_port
from services.gateway.batches.preempt import BatchRequests, Preemptible
from services.gateway.batches.runner import BatchRunner
from services.gateway.batches.sender import CelerySender
from services.gateway.batches.store import JobStore
from tests.integration.test_batch_lanes import submit
from tests.processes import ServiceProcess
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(240)
ACCESS = AccessControl([])
KEY = "tsk-batch-test"
SERVE_S = 0.6


class Serving:
    """Answers each chat request after ``SERVE_S`` and counts how often each prompt was served
    (to the end) and cut short (preempted)."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}
        self.cut: dict[str, int] = {}
        self.requests = BatchRequests(KEY)
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"])]
        self.app = Preemptible(Starlette(routes=routes), self.requests)

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        text = body["messages"][0]["content"]
        try:
            await asyncio.sleep(SERVE_S)
        except asyncio.CancelledError:
            self.cut[text] = self.cut.get(text, 0) + 1
            raise
        self.served[text] = self.served.get(text, 0) + 1
        answer = {
            "id": f"chatcmpl-{text}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13},
        }  # fmt: skip
        return JSONResponse(answer, headers={"x-tessera-devices": "worker-0"})


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    with RedisServer(acl=ACCESS.redis_acl()) as running:
        yield running  # type: ignore[misc]


def broker(server: RedisServer, user: str) -> str:
    return ACCESS.redis_url(server.url.rsplit("/", 1)[0] + "/1", user)


@pytest.fixture
async def serving() -> AsyncIterator[tuple[Serving, str]]:
    stand_in, port = Serving(), free_port()
    config = uvicorn.Config(stand_in.app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    yield stand_in, f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


def batch_worker(server: RedisServer, gateway: str, name: str) -> ServiceProcess:
    """A batch worker, with the key prefix the ACL was drawn for (the default)."""
    env = {
        "TESSERA_BATCH_BROKER_URL": broker(server, "batch"),
        "TESSERA_BATCH_GATEWAY_URL": gateway,
        "TESSERA_BATCH_GATEWAY_KEY": KEY,
        "TESSERA_BATCH_REQUEST_THREADS": "8",
    }
    return ServiceProcess(name, env, ["-m", "services.batch.worker"]).start(60)


async def run_batch(
    acl_redis: RedisServer, serving: tuple[Serving, str], uid: str, during: Any
) -> tuple[dict[str, Any], list[dict[str, Any]], CelerySender]:
    """A batch of 16 through a batch worker; ``during(runner, sender, worker)`` runs once the
    first answers are in. The batch as it ended, and its output lines."""
    stand_in, url = serving
    admin = Redis.from_url(ACCESS.redis_url(acl_redis.url, "admin"))
    sender = CelerySender(broker(acl_redis, "batch-sender"), "tessera", stand_in.requests.preempt)
    runner = BatchRunner(JobStore(admin, uid), sender, 4, lambda: 0, "edf")
    worker = await asyncio.to_thread(batch_worker, acl_redis, url, "batch-worker-1")
    running = asyncio.create_task(runner.run())
    try:
        created = await submit(runner, "job", 16, 3600)
        store = runner.store
        await wait_until_async(lambda: answered_at_least(store, created["id"], 3), 60)
        await during(runner, sender, worker)
        await wait_until_async(lambda: ended_batch(store, created["id"]), 120)
        ended = await store.batch(created["id"])
        assert ended is not None
        content = await store.content(ended["output_file_id"]) or b""
        return ended, [json.loads(line) for line in content.splitlines()], sender
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        worker.stop()
        await sender.aclose()
        await admin.aclose()


async def answered_at_least(store: JobStore, batch_id: str, count: int) -> bool:
    return len(await store.answered(batch_id)) >= count


async def ended_batch(store: JobStore, batch_id: str) -> bool:
    batch = await store.batch(batch_id)
    return batch is not None and batch["status"] == "completed"


async def test_a_batch_worker_killed_mid_batch_loses_and_repeats_nothing(
    acl_redis: RedisServer, serving: tuple[Serving, str], uid: str
) -> None:
    stand_in = serving[0]
    workers: list[ServiceProcess] = []

    async def kill_and_replace(runner: BatchRunner, sender: CelerySender, worker: Any) -> None:
        await wait_until_async(lambda: _running(stand_in), 30)  # some mid-request
        # (in threads: the stand-in serves on this event loop meanwhile)
        await asyncio.to_thread(worker.kill)  # SIGKILL: no goodbye, no ack
        workers.append(
            await asyncio.to_thread(batch_worker, acl_redis, serving[1], "batch-worker-2")
        )

    try:
        ended, lines, sender = await run_batch(acl_redis, serving, uid, kill_and_replace)
    finally:
        for worker in workers:
            worker.stop()
    ids = [line["custom_id"] for line in lines]
    assert sorted(ids) == sorted(f"job-{i}" for i in range(16))  # each once, none lost
    assert ended["error_file_id"] is None and ended["request_counts"]["failed"] == 0
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] == line["custom_id"]
               for line in lines)  # fmt: skip
    assert sender.lost >= 1  # the kill cut requests short, and they were sent again
    assert sum(stand_in.cut.values()) >= 1  # and the gateway stopped what they left running


async def test_an_interactive_request_preempts_what_a_batch_worker_runs(
    acl_redis: RedisServer, serving: tuple[Serving, str], uid: str
) -> None:
    stand_in = serving[0]

    async def chat_arrives(runner: BatchRunner, sender: CelerySender, worker: Any) -> None:
        await wait_until_async(lambda: _running(stand_in), 30)
        runner.busy = lambda: 1  # an interactive request in flight at the gateway
        runner.wake.set()
        await wait_until_async(lambda: _cut(stand_in), 30)
        await asyncio.sleep(1.0)
        assert not stand_in.requests.running  # nothing of the batch runs beside the chat
        runner.busy = lambda: 0

    _, lines, _ = await run_batch(acl_redis, serving, uid, chat_arrives)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"job-{i}" for i in range(16))
    assert sum(stand_in.cut.values()) >= 1  # cut short at the gateway, from another process


async def _running(stand_in: Serving) -> bool:
    return bool(stand_in.requests.running)


async def _cut(stand_in: Serving) -> bool:
    return bool(stand_in.cut)


async def test_with_no_batch_worker_a_request_is_answered_503_and_never_runs_later(
    acl_redis: RedisServer,
) -> None:
    """No worker takes it: each copy is given up after ``pickup_s`` (its claim marked, so a
    worker that comes later skips it) and, after ``pickups`` copies, the runner is answered 503
    (it backs off and tries again, as for any server error)."""
    gave_up: list[str] = []
    sender = CelerySender(
        broker(acl_redis, "batch-sender"), "tessera", gave_up.append, pickup_s=0.5, pickups=2
    )
    try:
        status, answer, _ = await sender("/v1/embeddings", {"model": "m", "input": "x"})
    finally:
        await sender.aclose()
    assert status == 503 and "no batch worker" in answer["error"]["message"]
    assert sender.resent == 2 and len(gave_up) == 2
    admin = Redis.from_url(ACCESS.redis_url(acl_redis.url.rsplit("/", 1)[0] + "/1", "admin"))
    try:
        claims = [await admin.get(f"tessera:batch:req:{task}") for task in gave_up]
    finally:
        await admin.aclose()
    assert claims == [b"abandoned", b"abandoned"]
