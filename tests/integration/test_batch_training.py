"""Training jobs, the second job kind (``tessera jobs submit --train``): each line a training run
that a real batch worker process trains itself, admitted and run by the same runner and policy
as the batches' requests, over the same Celery wire (a Redis with the cluster's ACL).

A run is elastic: preempted by a chat it stops at its next step, checkpointed, and resumes
there; its worker killed with ``kill -9``, it resumes on another worker from its last
checkpoint. Either way it ends with exactly the weights of a run that never stopped, and each
run is answered once. A cancelled job stops its runs at once and keeps their checkpoints."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from libs.cluster.servers import RedisServer
from services.batch.training import checkpoint_step, train
from services.gateway.batches.lines import read_lines, run_name
from services.gateway.batches.routes import BatchCreate, admitted
from services.gateway.batches.runner import BatchRunner
from services.gateway.batches.sender import CelerySender
from services.gateway.batches.store import JobStore
from tests.integration.test_batch_celery import ACCESS, KEY, acl_redis, broker
from tests.processes import ServiceProcess
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(240)
__all__ = ["acl_redis"]  # the module's Redis, shared
STEPS = 8000  # about 8 s a run on this machine: long enough to stop and kill mid-run


def worker(server: RedisServer, checkpoints: Path, name: str) -> ServiceProcess:
    env = {
        "TESSERA_BATCH_BROKER_URL": broker(server, "batch"),
        "TESSERA_BATCH_GATEWAY_URL": "http://127.0.0.1:9",  # training needs no gateway
        "TESSERA_BATCH_GATEWAY_KEY": KEY,
        "TESSERA_BATCH_CHECKPOINT_DIR": str(checkpoints),
        "TESSERA_BATCH_DEVICE_ID": name,
        "TESSERA_BATCH_REQUEST_THREADS": "4",
    }
    return ServiceProcess(name, env, ["-m", "services.batch.worker"]).start(60)


async def submit_training(
    runner: BatchRunner, runs: int, steps: int, window_s: float = 3600
) -> dict[str, Any]:
    lines = [
        {"custom_id": f"run-{seed}", "url": "/v1/tessera/train",
         "body": {"model": "tessera-mlp", "steps": steps, "every": 100, "seed": seed}}
        for seed in range(runs)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = await runner.store.add_file(content, "training.jsonl", "batch")
    body = BatchCreate(
        input_file_id=file["id"], endpoint="/v1/tessera/train", completion_window="1h"
    )
    parsed = read_lines(content, body.endpoint)
    async with runner.admitting:
        return await admitted(runner, body, parsed, "tessera-mlp", window_s)


class Training:
    """A runner with a Celery sender, a first worker, and what the test does; as a context,
    the runner runs inside it and everything is stopped at its end."""

    def __init__(self, server: RedisServer, checkpoints: Path, uid: str) -> None:
        self.server, self.checkpoints = server, checkpoints
        self.admin = Redis.from_url(ACCESS.redis_url(server.url, "admin"))
        self.sender = CelerySender(broker(server, "batch-sender"), "tessera", lambda _: None)
        self.runner = BatchRunner(JobStore(self.admin, uid), self.sender, 2, lambda: 0, "edf")
        self.workers = [worker(server, checkpoints, "trainer-1")]

    def step(self, batch: dict[str, Any], custom_id: str) -> int:
        return checkpoint_step(self.checkpoints, run_name(batch["id"], custom_id))

    async def ended(self, batch_id: str, status: str) -> dict[str, Any]:
        async def done() -> bool:
            found = await self.runner.store.batch(batch_id)
            return found is not None and found["status"] == status

        await wait_until_async(done, 120)
        found = await self.runner.store.batch(batch_id)
        assert found is not None
        return found

    async def rows(self, file_id: str | None) -> list[dict[str, Any]]:
        content = await self.runner.store.content(file_id) if file_id else b""
        return [json.loads(line) for line in (content or b"").splitlines()]

    async def __aenter__(self) -> Training:
        self.running = asyncio.create_task(self.runner.run())
        return self

    async def __aexit__(self, *_: object) -> None:
        self.running.cancel()
        await asyncio.gather(self.running, return_exceptions=True)
        for process in self.workers:
            process.stop()
        await self.sender.aclose()
        await self.admin.aclose()


async def test_a_training_run_preempted_then_killed_ends_with_the_weights_of_an_unbroken_run(
    acl_redis: RedisServer, tmp_path: Path, uid: str
) -> None:
    async with Training(acl_redis, tmp_path / "checkpoints", uid) as it:
        # A day's window: never so near its deadline that it must run beside the chat.
        batch = await submit_training(it.runner, 2, STEPS, 86_400)
        assert "admitted (edf)" in batch["decision"] and "training steps" in batch["decision"]
        await wait_until_async(lambda: _past(it, batch, 500), 60)
        # The job's progress counts the steps its runs have made (reported about once a second).
        await wait_until_async(lambda: _steps_at_least(it, batch["id"], 1000), 30)
        # A chat arrives: the runs stop at their next step, checkpointed, and stay stopped.
        it.runner.busy = lambda: 1
        it.runner.wake.set()
        stopped = await _held_still(it, batch)
        await asyncio.sleep(1.5)
        assert [it.step(batch, f"run-{i}") for i in range(2)] == stopped
        assert all(0 < s < STEPS for s in stopped)
        it.runner.busy = lambda: 0  # the chat is done: they resume where they stopped
        await wait_until_async(lambda: _past(it, batch, max(stopped) + 300), 60)
        await asyncio.to_thread(it.workers[0].kill)  # SIGKILL mid-run: no goodbye
        it.workers.append(await asyncio.to_thread(worker, acl_redis, it.checkpoints, "trainer-2"))
        ended = await it.ended(batch["id"], "completed")
        rows = await it.rows(ended["output_file_id"])
    assert sorted(r["custom_id"] for r in rows) == ["run-0", "run-1"]  # each once
    assert ended["error_file_id"] is None and it.sender.lost >= 1
    assert ended["training"] == {"steps_done": 2 * STEPS, "steps_total": 2 * STEPS}
    for row in rows:
        run = row["response"]["body"]
        seed = int(row["custom_id"].removeprefix("run-"))
        unbroken = await asyncio.to_thread(train, f"alone-{seed}", STEPS, tmp_path, seed=seed)
        assert run["steps"] == STEPS and run["resumed_from"] > 0, run
        assert run["weights_sha256"] == unbroken.weights_sha256, run
        assert run["device"] == "trainer-2" and Path(run["checkpoint"]).exists()
    # The rate's sample runs kept no checkpoint: the job's two runs are all there is.
    assert len(list(it.checkpoints.glob("*.pt"))) == 2


async def _past(it: Training, batch: dict[str, Any], step: int, runs: int = 2) -> bool:
    return all(it.step(batch, f"run-{i}") >= step for i in range(runs))


async def _held_still(it: Training, batch: dict[str, Any]) -> list[int]:
    """The runs' checkpointed steps once they have not moved for a second (within 30 s)."""
    before = [it.step(batch, f"run-{i}") for i in range(2)]
    for _ in range(30):
        await asyncio.sleep(1.0)
        now = [it.step(batch, f"run-{i}") for i in range(2)]
        if now == before:
            return now
        before = now
    raise AssertionError(f"the runs did not stop: checkpointed at {before}")


async def _steps_at_least(it: Training, batch_id: str, steps: int) -> bool:
    found = await it.runner.store.batch(batch_id)
    return found is not None and found["training"]["steps_done"] >= steps


async def test_a_cancelled_training_job_stops_its_run_at_once_and_keeps_its_checkpoint(
    acl_redis: RedisServer, tmp_path: Path, uid: str
) -> None:
    async with Training(acl_redis, tmp_path / "checkpoints", uid) as it:
        batch = await submit_training(it.runner, 1, 1_000_000, 86_400)  # some twenty minutes
        await wait_until_async(lambda: _past(it, batch, 300, runs=1), 60)
        await it.runner.store.cancel(batch["id"])
        it.runner.wake.set()
        ended = await it.ended(batch["id"], "cancelled")
        errors = await it.rows(ended["error_file_id"])
        kept = it.step(batch, "run-0")
        await asyncio.sleep(1.0)
        assert it.step(batch, "run-0") == kept  # the worker stopped training
        on_broker = Redis.from_url(broker(acl_redis, "admin"))
        alive = await on_broker.keys("tessera:batch:alive:*")
        await on_broker.aclose()
    assert [r["custom_id"] for r in errors] == ["run-0"]
    assert errors[0]["error"]["code"] == "batch_cancelled"
    assert 300 <= kept < 1_000_000 and alive == []
    assert 0 < ended["training"]["steps_done"] <= kept  # what it trained, as last reported


def test_the_worker_refuses_a_run_whose_name_is_no_file_name(tmp_path: Path) -> None:
    from services.batch.train_runs import train_run

    status, answer, _ = train_run(
        {"run": "../../etc/x", "steps": 5}, tmp_path, "here", lambda: False
    )
    assert status == 400 and "not a name" in answer["error"]["message"]
    assert not list(tmp_path.iterdir())  # nothing written
