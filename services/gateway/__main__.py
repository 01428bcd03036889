"""Run the gateway: ``python -m services.gateway``."""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from libs.runtime.lifecycle import announce_ready
from libs.runtime.logs import configure_logging
from libs.runtime.tracing import configure_tracing, instrument
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


async def serve(settings: GatewaySettings) -> None:
    app = create_app(settings)
    instrument(configure_tracing("gateway", settings.otlp_endpoint), app)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
        # Dashboards follow an endless event stream: a stop does not wait on them for long.
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        announce_ready("gateway", url=f"{settings.scheme}://{settings.host}:{settings.port}")
    await task
    if not server.started:
        raise SystemExit(1)


def main() -> int:
    settings = GatewaySettings()
    configure_logging("gateway", settings.log_level, settings.log_format)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
