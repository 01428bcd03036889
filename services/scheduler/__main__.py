"""Run the scheduler: ``python -m services.scheduler``."""

from __future__ import annotations

import asyncio
import sys

from libs.runtime.bus import close_nats, connect_nats
from libs.runtime.http import start_http, stop_http
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.store import connect_redis
from libs.runtime.tracing import configure_tracing, instrument
from services.scheduler.api import create_api
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings


async def main(stop: asyncio.Event, settings: SchedulerSettings) -> None:
    provider = configure_tracing("scheduler", settings.otlp_endpoint)
    nc = await connect_nats(settings.nats_url, "scheduler")
    redis = connect_redis(settings.redis_url)
    await redis.ping()
    scheduler = Scheduler(settings, nc, redis, SchedulerMetrics.create())
    await scheduler.start()
    app = create_api(scheduler)
    instrument(provider, app)
    server, task = await start_http(app, settings.http_host, settings.http_port)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else settings.http_port
    announce_ready("scheduler", url=f"http://{settings.http_host}:{port}")
    await stop.wait()
    await stop_http(server, task)
    await scheduler.stop()
    await close_nats(nc)
    await redis.aclose()


if __name__ == "__main__":
    settings = SchedulerSettings()
    configure_logging("scheduler", settings.log_level, settings.log_format)
    sys.exit(run_service("scheduler", lambda stop: main(stop, settings)))
