"""Run the scheduler: ``python -m services.scheduler``.

Replicas elect a leader (``leader.py``). A replica that cannot take the lease at once reports
ready as a follower and waits; the leader restores the latest checkpoint, reconciles it with
live telemetry, decides, and serves the HTTP API. A leader that loses its lease exits without
writing anything (its supervisor starts it again, as a follower).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from libs.contracts.keys import Keys
from libs.runtime.bus import NatsBus
from libs.runtime.connections import connected
from libs.runtime.http import start_http, stop_http
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.nats_client import ensure_streams
from libs.runtime.tracing import configure_tracing, instrument
from services.scheduler.api import create_api
from services.scheduler.checkpoints import CheckpointStore
from services.scheduler.leader import Lease
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings

log = logging.getLogger("services.scheduler")


class LeaseLost(RuntimeError):
    pass


async def main(stop: asyncio.Event, settings: SchedulerSettings) -> None:
    provider = configure_tracing("scheduler", settings.otlp_endpoint)
    async with connected(settings, "scheduler") as (nc, redis):
        metrics = SchedulerMetrics.create()
        metrics.leader.set(0)
        lease = Lease(nc, settings.replica, ttl_s=settings.lease_s)
        following = not await lease.try_acquire()
        if following:
            announce_ready("scheduler", role="follower", replica=settings.replica)
            if not await lease.acquire(stop):
                return  # stopped while following
        await ensure_streams(nc)
        checkpoints = CheckpointStore(
            redis, nc, Keys(settings.key_prefix), settings.checkpoints_kept
        )
        scheduler = Scheduler(settings, NatsBus(nc), redis, checkpoints, metrics)
        await scheduler.start()
        metrics.leader.set(1)
        lost = asyncio.Event()
        holding = asyncio.create_task(lease.hold(lost, stop))
        app = create_api(scheduler)
        instrument(provider, app)
        server, task = await start_http(app, settings.http_host, settings.http_port)
        sockets = server.servers[0].sockets if server.servers else []
        port = sockets[0].getsockname()[1] if sockets else settings.http_port
        url = f"http://{settings.http_host}:{port}"
        if following:
            log.warning("took over as leader", extra={"replica": settings.replica, "url": url})
        else:
            await nc.flush()  # the server holds our subscriptions before we say ready
            announce_ready("scheduler", url=url, role="leader", replica=settings.replica)
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(lost.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()
        await stop_http(server, task)
        if lost.is_set():
            metrics.leader.set(0)
            await scheduler.abandon()
            raise LeaseLost(f"{settings.replica} lost the leader lease; stepping down")
        await holding
        await scheduler.stop()
        await lease.release()


if __name__ == "__main__":
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level, settings.log_format)
    sys.exit(run_service("scheduler", lambda stop: main(stop, settings)))
