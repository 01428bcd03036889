"""Run a service until SIGTERM/SIGINT, then let it shut down cleanly.

A service's ``__main__`` calls ``run_service(name, main)`` where ``main(stop)`` builds its
adapters, logs ``ready`` (the line ``tessera up`` waits for), awaits ``stop`` and cleans up.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

READY_MESSAGE = "ready"


def announce_ready(service: str, **details: object) -> None:
    """Log the readiness line the launcher and the tests wait for."""
    log.info(READY_MESSAGE, extra={"ready_service": service, **details})


def run_service(service: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main`` with a stop event that signals set; return a process exit code."""

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(_run())
    except Exception:
        log.exception("service crashed", extra={"crashed_service": service})
        return 1
    log.info("stopped", extra={"stopped_service": service})
    return 0
