"""Run a service until SIGTERM/SIGINT, then let it shut down cleanly.

A service's ``__main__`` calls ``run_service(name, main)`` where ``main(stop)`` builds its
adapters, logs ``ready`` (the line ``tessera up`` waits for), awaits ``stop`` and cleans up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from libs.runtime.bus import Unsubscribe
from libs.runtime.cancelling import stopping
from libs.runtime.settings import ready_file

log = logging.getLogger(__name__)

READY_MESSAGE = "ready"


def announce_ready(service: str, **details: object) -> None:
    """Log the readiness line the launcher and the tests wait for. Flush the NATS connection
    first: a subscription not yet at the server would miss what is sent right after. With
    ``TESSERA_READY_FILE`` set, that file is written too (a container's healthcheck tests it)."""
    log.info(READY_MESSAGE, extra={"ready_service": service, **details})
    if (path := ready_file()) is not None:
        path.write_text(f"{service}\n")


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


class Background:
    """A service's periodic steps and subscriptions, stopped together.

    A step that raises is logged with its traceback and runs again next period.
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.tasks: list[asyncio.Task[None]] = []
        self.subscriptions: list[Unsubscribe] = []

    def every(
        self,
        period_s: float,
        step: Callable[[], Awaitable[None]],
        due_in_s: Callable[[], float] | None = None,
    ) -> None:
        """Run ``step`` every ``period_s``, or sooner: after ``due_in_s()`` seconds when that
        is shorter (a step that knows when it next has work, such as a deadline)."""
        self.tasks.append(asyncio.create_task(self._loop(period_s, step, due_in_s)))

    async def _loop(
        self,
        period_s: float,
        step: Callable[[], Awaitable[None]],
        due_in_s: Callable[[], float] | None,
    ) -> None:
        while not stopping():
            wait = period_s if due_in_s is None else max(0.0, min(period_s, due_in_s()))
            await asyncio.sleep(wait)
            try:
                await step()
            except Exception:
                log.exception(
                    "periodic step failed",
                    extra={"failed_service": self.service, "step": step.__name__},
                )

    async def close(self) -> None:
        for sub in self.subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks, self.subscriptions = [], []
