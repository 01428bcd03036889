"""The Celery app: Redis broker, one queue per device, late acks so a killed worker's job returns.

The batches' requests (``tessera.request``, queue ``batch.requests``) are run by
``python -m services.batch.worker`` (a thread per request in flight): each is sent to the
gateway's serving path, or, a training run, trained in the worker.

Run a device's worker with ``celery -A services.batch.app worker -Q device.<device_id>
--pool=solo``. The scheduler's placement picks the queue (``dispatch.py``). ``acks_late`` with
``task_reject_on_worker_lost``: a job is acknowledged only when it finishes, so a worker killed
mid-job leaves it unacknowledged and the broker hands it out again after the visibility timeout.
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from celery import Celery
from celery.signals import worker_init
from redis import Redis

from libs.contracts.batch_requests import QUEUE, TASK, TRAIN_ENDPOINT
from libs.runtime.tracing import configure_tracing, instrument_celery
from services.batch.requests import report_steps, run_request, send, stopped
from services.batch.settings import BatchSettings
from services.batch.train_runs import train_run
from services.batch.training import train


def queue_of(device_id: str) -> str:
    return f"device.{device_id}"


def make_app(settings: BatchSettings) -> Celery:
    app = Celery("tessera", broker=settings.broker_url, backend=settings.broker_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="device.unplaced",
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        result_expires=24 * 3600,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
    )

    @app.task(name="tessera.train", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def train_job(
        self: Any, job_id: str, steps: int, attempt: int = 1, every: int = 5, step_s: float = 0.0
    ) -> dict[str, Any]:
        device_id = self.request.delivery_info.get("routing_key", "").removeprefix("device.")
        result = train(
            job_id,
            steps,
            Path(settings.checkpoint_dir),
            device_id=device_id,
            attempt=attempt,
            every=every,
            step_s=step_s,
        )
        return asdict(result)

    made: list[tuple[Redis, httpx.Client]] = []
    making = threading.Lock()

    def clients() -> tuple[Redis, httpx.Client]:  # one each per worker process, its threads'
        with making:
            if not made:
                headers = {"authorization": f"Bearer {settings.gateway_key.get_secret_value()}"}
                gateway = httpx.Client(
                    base_url=settings.gateway_url,
                    headers=headers,
                    timeout=httpx.Timeout(settings.request_timeout_s, connect=10.0),
                    limits=httpx.Limits(max_connections=settings.request_threads),
                )
                made.append((Redis.from_url(settings.broker_url), gateway))
            return made[0]

    @app.task(name=TASK, bind=True, shared=False, queue=QUEUE, ignore_result=True)  # type: ignore[untyped-decorator]
    def request(self: Any, endpoint: str, body: dict[str, Any]) -> bool:
        """One request of a batch (``requests.py``), or a training run trained here
        (``train_runs.py``); its answer goes to Redis, not the result backend."""
        redis, gateway = clients()
        task_id, prefix = self.request.id, settings.key_prefix
        if endpoint == TRAIN_ENDPOINT:
            place = Path(settings.checkpoint_dir)
            stop = partial(stopped, redis, prefix, task_id)
            report = partial(report_steps, redis, prefix)
            work = partial(train_run, body, place, settings.device_id, stop, report)
        else:
            work = partial(send, gateway, task_id, endpoint, body)
        worker = self.request.hostname  # name@host
        return run_request(redis, prefix, task_id, worker, work)

    return app


app = make_app(BatchSettings())


@worker_init.connect  # type: ignore[untyped-decorator]
def _trace_worker(**_: object) -> None:
    """The worker traces its jobs as children of the dispatcher's publish span (the SDK's span
    processors restart themselves in forked pool children)."""
    instrument_celery(configure_tracing("batch-worker", BatchSettings().otlp_endpoint))
