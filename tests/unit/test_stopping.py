"""Loops that run until cancelled end even when an await inside swallows the cancellation
(Python 3.11's ``asyncio.wait_for`` does when what it waits on ends as it is cancelled): the
scheduler's stop and a service's ``Background.close`` hung for ever on it (a CI run timed out
in ``test_a_restarted_scheduler_keeps_each_deployments_phase``)."""

from __future__ import annotations

import asyncio
import contextlib

from libs.runtime.lifecycle import Background
from services.scheduler.loop import CommandLoop


async def swallowing() -> None:
    """What an await that swallows its cancellation looks like to the loop around it."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(30)


async def test_the_scheduler_s_command_loop_closes_when_a_command_swallows_the_cancel() -> None:
    loop = CommandLoop()
    loop.start()
    loop.post(swallowing, "swallowing")
    await asyncio.sleep(0.05)  # the command is running
    await asyncio.wait_for(loop.close(), 5)
    assert loop.applied == 1


async def test_a_periodic_step_that_swallows_the_cancel_does_not_keep_close_waiting() -> None:
    background = Background("test")
    background.every(0.01, swallowing)
    await asyncio.sleep(0.05)  # the step is running
    await asyncio.wait_for(background.close(), 5)
    assert background.tasks == []
