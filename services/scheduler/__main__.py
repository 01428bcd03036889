"""Run the scheduler: ``python -m services.scheduler``."""

from __future__ import annotations

import asyncio
import sys

from libs.runtime.connections import connected
from libs.runtime.http import start_http, stop_http
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.tracing import configure_tracing, instrument
from services.scheduler.api import create_api
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings


async def main(stop: asyncio.Event, settings: SchedulerSettings) -> None:
    provider = configure_tracing("scheduler", settings.otlp_endpoint)
    async with connected(settings, "scheduler") as (nc, redis):
        scheduler = Scheduler(settings, nc, redis, SchedulerMetrics.create())
        await scheduler.start()
        app = create_api(scheduler)
        instrument(provider, app)
        server, task = await start_http(app, settings.http_host, settings.http_port)
        sockets = server.servers[0].sockets if server.servers else []
        port = sockets[0].getsockname()[1] if sockets else settings.http_port
        announce_ready("scheduler", url=f"http://{settings.http_host}:{port}")
        await stop.wait()
        await stop_http(server, task)
        await scheduler.stop()


if __name__ == "__main__":
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level, settings.log_format)
    sys.exit(run_service("scheduler", lambda stop: main(stop, settings)))
