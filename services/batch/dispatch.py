"""From the scheduler's placements to Celery: each placed job goes to its device's queue.

The scheduler decides where a ``BatchJob`` runs (``PLACEMENT_DECISION``, kind ``job``). The
dispatcher sends it to that device's queue with ``apply_async(queue=…)``. When the device fails
the scheduler places the job again elsewhere; the dispatcher sends it there with the next
``attempt``, and the job resumes from its last checkpoint (an older attempt that wakes up later
finds the newer checkpoint and stops).
"""

from __future__ import annotations

import logging

from celery import Celery
from celery.result import AsyncResult

from libs.contracts import BatchJob, PlacementDecision
from services.batch.app import queue_of

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, app: Celery) -> None:
        self.app = app
        self.jobs: dict[str, BatchJob] = {}
        self.placed: dict[str, tuple[str, int]] = {}  #: job id → (device, attempt)

    def remember(self, job: BatchJob) -> None:
        self.jobs[job.job_id] = job

    def on_decision(self, decision: PlacementDecision) -> AsyncResult | None:
        if decision.kind != "job" or not decision.placed:
            return None
        job = self.jobs.get(decision.task_id)
        if job is None:
            return None
        device = decision.assignments[0].device_id
        previous = self.placed.get(job.job_id)
        if previous is not None and previous[0] == device:
            return None  # the same placement again
        return self.dispatch(job, device, previous[1] + 1 if previous else 1)

    def dispatch(self, job: BatchJob, device_id: str, attempt: int) -> AsyncResult:
        if job.task_name not in self.app.tasks:
            raise KeyError(f"no batch task {job.task_name!r}")
        self.placed[job.job_id] = (device_id, attempt)
        log.info(
            "dispatched job",
            extra={"job_id": job.job_id, "device_id": device_id, "attempt": attempt},
        )
        return self.app.tasks[job.task_name].apply_async(
            kwargs={**job.args, "job_id": job.job_id, "attempt": attempt},
            queue=queue_of(device_id),
            task_id=f"{job.job_id}-{attempt}",
        )
