"""The scheduler's one writer: commands applied in order, one at a time, by one task.

NATS handlers, HTTP handlers and timers do not change the scheduler's state: they put a
command (a coroutine function) on this queue, with a future where the caller needs the
answer, and one task applies them in the order they came (as exo's master applies indexed
events). So a deploy from the HTTP API, a cycle and a worker's report never interleave inside
each other, and what is checkpointed is the state as the commands left it. A command must not
wait on slow I/O longer than needed: reads it depends on are made before it is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from libs.runtime.cancelling import stopping

log = logging.getLogger(__name__)
T = TypeVar("T")

Command = tuple[Callable[[], Awaitable[Any]], "asyncio.Future[Any] | None", str]


class CommandLoop:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Command] = asyncio.Queue()
        #: Commands applied so far: the index of the next one.
        self.applied = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._run(), name="scheduler-commands")
        return self._task

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop: first apply what is queued, for ``drain_s`` at most (a clean stop), then
        cancel; commands still queued are dropped."""
        if self._task is not None and drain_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.call(_nothing, "drain"), drain_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while not self.queue.empty():
            _, future, _ = self.queue.get_nowait()
            if future is not None and not future.done():
                future.cancel()

    def post(self, command: Callable[[], Awaitable[Any]], name: str) -> None:
        """Apply ``command`` in its turn; nobody waits for it (errors are logged)."""
        self.queue.put_nowait((command, None, name))

    async def call(self, command: Callable[[], Awaitable[T]], name: str) -> T:
        """Apply ``command`` in its turn and return its result (or raise its error)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((command, future, name))
        return await future

    async def _run(self) -> None:
        while not stopping():
            command, future, name = await self.queue.get()
            if future is not None and future.cancelled():
                continue
            try:
                result = await command()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if future is not None and not future.done():
                    future.set_exception(exc)
                else:
                    log.exception("scheduler command failed", extra={"command": name})
            else:
                if future is not None and not future.done():
                    future.set_result(result)
            finally:
                self.applied += 1


async def _nothing() -> None:
    """A command that changes nothing: applied, every command queued before it was too."""
