"""Polling helpers for tests that wait on another process (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    condition: Callable[[], object], timeout_s: float, step_s: float = 0.05
) -> None:
    """Poll ``condition`` until it is truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)


async def wait_until_async(
    condition: Callable[[], Awaitable[object]], timeout_s: float, step_s: float = 0.05
) -> None:
    """``wait_until`` for a condition that must be awaited (a Redis read, an HTTP call)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)
