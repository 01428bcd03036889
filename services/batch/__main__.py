"""Run the batch dispatcher: ``python -m services.batch`` (settings: ``TESSERA_BATCH_*``).

It learns each ``BatchJob`` from the placement requests and sends it to the queue of the device
the scheduler places it on (again, with the next attempt, when the job is re-placed). Each
device's Celery worker: ``celery -A services.batch.app worker -Q device.<id> --pool=solo``.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import redis

from libs.contracts import (
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    BatchJob,
    PlacementDecision,
    PlacementRequest,
)
from libs.runtime.bus import Delivery, NatsBus
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.tracing import configure_tracing, instrument_celery
from services.batch.app import make_app
from services.batch.dispatch import Dispatcher, JobBook
from services.batch.settings import BatchSettings

log = logging.getLogger("services.batch")


async def main(stop: asyncio.Event, settings: BatchSettings) -> None:
    instrument_celery(configure_tracing("batch", settings.otlp_endpoint))
    book = JobBook(
        redis.Redis.from_url(settings.broker_url), settings.key_prefix, settings.job_ttl_s
    )
    dispatcher = Dispatcher(make_app(settings), book)
    nc = await connect_nats(settings.nats_url, "batch", ca_file=settings.nats_ca)
    bus = NatsBus(nc)

    async def on_request(request: PlacementRequest, msg: Delivery) -> None:
        if isinstance(request.task, BatchJob):
            dispatcher.remember(request.task)

    async def on_decision(decision: PlacementDecision, msg: Delivery) -> None:
        try:
            await asyncio.to_thread(dispatcher.on_decision, decision)
        except Exception:
            log.exception("dispatch failed", extra={"job_id": decision.task_id})

    subs = [
        await bus.subscribe(PLACEMENT_REQUEST, on_request),
        await bus.subscribe(PLACEMENT_DECISION, on_decision),
    ]
    await nc.flush()  # the server holds our subscriptions before we say ready
    announce_ready("batch")
    await stop.wait()
    for sub in subs:
        await sub.unsubscribe()
    await close_nats(nc)


if __name__ == "__main__":
    settings = BatchSettings()
    configure_logging("batch", settings.log_level, settings.log_format)
    sys.exit(run_service("batch", lambda stop: main(stop, settings)))
