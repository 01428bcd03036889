"""From the scheduler's placements to Celery: each placed job goes to its device's queue.

The scheduler decides where a ``BatchJob`` runs (``PLACEMENT_DECISION``, kind ``job``). The
dispatcher sends it to that device's queue with ``apply_async(queue=…)``. When the device fails
the scheduler places the job again elsewhere; the dispatcher sends it there with the next
``attempt``, and the job resumes from its last checkpoint (an older attempt that wakes up later
finds the newer checkpoint and stops). What it knows of each job lives in Redis (``JobBook``).
"""

from __future__ import annotations

import logging

from celery import Celery
from celery.result import AsyncResult
from redis import Redis

from libs.contracts import BatchJob, PlacementDecision
from services.batch.app import queue_of

log = logging.getLogger(__name__)


class JobBook:
    """The jobs the dispatcher knows and where each was last sent, kept in the broker's Redis:
    a restarted dispatcher still knows them, and each entry expires ``ttl_s`` after its last
    change, so finished jobs do not pile up."""

    def __init__(self, redis: Redis, prefix: str, ttl_s: float) -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, int(ttl_s)

    def _key(self, kind: str, job_id: str) -> str:
        return f"{self.prefix}:batch:{kind}:{job_id}"

    def remember(self, job: BatchJob) -> None:
        self.redis.set(self._key("job", job.job_id), job.model_dump_json(), ex=self.ttl_s)

    def job(self, job_id: str) -> BatchJob | None:
        stored = self.redis.get(self._key("job", job_id))
        return BatchJob.model_validate_json(stored) if stored else None

    def placed(self, job_id: str) -> tuple[str, int] | None:
        """(device, attempt) of the job's last dispatch."""
        stored = self.redis.get(self._key("placed", job_id))
        if not stored:
            return None
        device, attempt = str(stored.decode() if isinstance(stored, bytes) else stored).split()
        return device, int(attempt)

    def place(self, job_id: str, device_id: str, attempt: int) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self._key("placed", job_id), f"{device_id} {attempt}", ex=self.ttl_s)
        pipe.expire(self._key("job", job_id), self.ttl_s)
        pipe.execute()


class Dispatcher:
    def __init__(self, app: Celery, book: JobBook) -> None:
        self.app, self.book = app, book

    def remember(self, job: BatchJob) -> None:
        self.book.remember(job)

    def on_decision(self, decision: PlacementDecision) -> AsyncResult | None:
        if decision.kind != "job" or not decision.placed:
            return None
        job = self.book.job(decision.task_id)
        if job is None:
            return None
        device = decision.assignments[0].device_id
        previous = self.book.placed(job.job_id)
        if previous is not None and previous[0] == device:
            return None  # the same placement again
        return self.dispatch(job, device, previous[1] + 1 if previous else 1)

    def dispatch(self, job: BatchJob, device_id: str, attempt: int) -> AsyncResult:
        if job.task_name not in self.app.tasks:
            raise KeyError(f"no batch task {job.task_name!r}")
        self.book.place(job.job_id, device_id, attempt)
        log.info(
            "dispatched job",
            extra={"job_id": job.job_id, "device_id": device_id, "attempt": attempt},
        )
        return self.app.tasks[job.task_name].apply_async(
            kwargs={**job.args, "job_id": job.job_id, "attempt": attempt},
            queue=queue_of(device_id),
            task_id=f"{job.job_id}-{attempt}",
        )
