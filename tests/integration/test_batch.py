"""Celery batch jobs for real: Redis broker, one worker process per device queue, a PyTorch
training job checkpointed to shared storage, killed mid-run and resumed elsewhere."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from libs.cluster.servers import RedisServer
from libs.contracts import Assignment, BatchJob, Mode, PlacementDecision
from services.batch.app import make_app
from services.batch.dispatch import Dispatcher, JobBook
from services.batch.settings import BatchSettings
from services.batch.training import checkpoint_step, train
from tests.processes import ServiceProcess

pytestmark = pytest.mark.timeout(300)
STEPS = 60


@pytest.fixture
def settings(redis_server: RedisServer, tmp_path: Path) -> BatchSettings:
    return BatchSettings(
        broker_url=f"{redis_server.url.rsplit('/', 1)[0]}/3",
        checkpoint_dir=tmp_path / "checkpoints",
        visibility_timeout_s=3.0,
    )


def celery_worker(device_id: str, settings: BatchSettings) -> ServiceProcess:
    argv = ["-m", "celery", "-A", "services.batch.app", "worker", "-Q", f"device.{device_id}"]
    argv += ["-n", f"{device_id}@tessera", "--pool=solo", "--loglevel=INFO"]
    argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    env = {
        "TESSERA_BATCH_BROKER_URL": settings.broker_url,
        "TESSERA_BATCH_CHECKPOINT_DIR": str(settings.checkpoint_dir),
        "TESSERA_BATCH_VISIBILITY_TIMEOUT_S": str(settings.visibility_timeout_s),
        "TESSERA_OTLP_ENDPOINT": f"file://{settings.checkpoint_dir.parent / 'spans'}",
    }
    ready = lambda e: " ready." in e.get("msg", "")  # noqa: E731
    return ServiceProcess(f"celery-{device_id}", env, argv, ready_line=ready).start(60)


@pytest.fixture
def workers(settings: BatchSettings) -> Iterator[dict[str, ServiceProcess]]:
    running = {d: celery_worker(d, settings) for d in ("cw-a", "cw-b")}
    yield running
    for worker in running.values():
        worker.stop()


def decision(job_id: str, device_id: str, epoch: int) -> PlacementDecision:
    """What the scheduler publishes when it places (or re-places) a job."""
    return PlacementDecision(
        task_id=job_id,
        kind="job",
        placed=True,
        assignments=(Assignment(device_id=device_id),),
        policy="dwps",
        mode=Mode.BALANCED,
        epoch=epoch,
        ts=time.time(),
    )


def book(settings: BatchSettings) -> JobBook:
    return JobBook(redis.Redis.from_url(settings.broker_url), "t", settings.job_ttl_s)


def test_a_restarted_dispatcher_still_knows_its_jobs_and_where_they_ran(
    settings: BatchSettings,
) -> None:
    """What the dispatcher knows lives in Redis: after a restart, a job re-placed elsewhere
    goes out as its next attempt, and a repeated placement is not sent twice."""
    # A broker database of its own: no worker of the other test takes these jobs.
    settings = settings.model_copy(update={"broker_url": settings.broker_url[:-1] + "4"})
    app = make_app(settings)
    job = BatchJob(
        job_id="restart-1",
        task_name="tessera.train",
        work_gflop=1.0,
        memory_gb=0.1,
        args={"steps": 5},
    )
    first = Dispatcher(app, book(settings))
    first.remember(job)
    assert first.on_decision(decision(job.job_id, "cw-a", 1)) is not None
    again = Dispatcher(app, book(settings))  # a new process: nothing in memory
    assert again.on_decision(decision(job.job_id, "cw-a", 1)) is None
    moved = again.on_decision(decision(job.job_id, "cw-b", 2))
    assert moved is not None and moved.id == "restart-1-2"
    client = redis.Redis.from_url(settings.broker_url)
    assert 0 < client.ttl(f"t:batch:job:{job.job_id}") <= settings.job_ttl_s  # it expires


def wait_for_checkpoint(settings: BatchSettings, job_id: str, step: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = checkpoint_step(settings.checkpoint_dir, job_id)
        if done >= step:
            return done
        time.sleep(0.05)
    raise AssertionError(f"{job_id} never reached step {step}")


def test_a_training_job_killed_mid_run_resumes_from_its_checkpoint_elsewhere(
    settings: BatchSettings, workers: dict[str, ServiceProcess], tmp_path: Path
) -> None:
    reference = train("reference", STEPS, tmp_path / "reference")  # never interrupted
    app = make_app(settings)
    dispatcher = Dispatcher(app, book(settings))
    job = BatchJob(
        job_id="train-1",
        task_name="tessera.train",
        work_gflop=1.0,
        memory_gb=0.1,
        args={"steps": STEPS, "every": 5, "step_s": 0.1},
    )
    dispatcher.remember(job)
    first = dispatcher.on_decision(decision(job.job_id, "cw-a", 1))
    assert first is not None
    reached = wait_for_checkpoint(settings, job.job_id, 15)
    workers["cw-a"].kill()  # the device dies mid-run
    killed_at = time.time()
    at_kill = checkpoint_step(settings.checkpoint_dir, job.job_id)
    assert at_kill < STEPS

    # The scheduler re-places the job on another device: it goes to that device's queue.
    moved = dispatcher.on_decision(decision(job.job_id, "cw-b", 2))
    assert moved is not None
    result = moved.get(timeout=120)
    migration_s = result["first_step_at"] - killed_at
    print(f"migration: killed at step >= {reached}, resumed after {migration_s:.2f} s")
    assert result["device_id"] == "cw-b" and result["attempt"] == 2
    assert result["resumed_from"] == at_kill and at_kill % 5 == 0  # the last checkpoint
    assert result["final_step"] == STEPS
    assert result["weights_sha256"] == reference.weights_sha256  # as if it never stopped
    assert migration_s > 0  # its first step on cw-b came after cw-a died, not before

    # acks_late: the killed worker never acknowledged attempt 1. Back on its queue, the job is
    # handed out again; it finds attempt 2's checkpoint and stops without training.
    workers["cw-a"].start(60)
    again = first.get(timeout=60)
    assert again["superseded"] and again["final_step"] == STEPS
    assert checkpoint_step(settings.checkpoint_dir, job.job_id) == STEPS

    # Celery's own instrumentation traced each run in the worker that ran it.
    runs = [
        json.loads(line)
        for path in (tmp_path / "spans").glob("batch-worker-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    traced = {r["attributes"].get("celery.task_name") for r in runs if r["name"].startswith("run/")}
    assert traced == {"tessera.train"}
