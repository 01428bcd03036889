"""Whether a long-lived task was asked to stop, for the loops that run until cancelled."""

from __future__ import annotations

import asyncio


def stopping() -> bool:
    """Whether the running task was asked to stop. True also where an await inside swallowed
    the cancellation (Python 3.11's ``asyncio.wait_for`` does when what it waits on ends as it
    is cancelled): a loop that checks it ends, where one that only awaits again would wait for
    ever, and whoever awaits the cancelled task with it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
