"""The batch runner's sums, and a request cancelled before its first piece (a preempted batch
request): its generations stop and its place under the concurrency limit comes back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

from libs.contracts import TokenChunk
from libs.core.batch_policies import need_s
from services.gateway.batches.lines import BatchLine
from services.gateway.batches.runner import Progress
from services.gateway.core.answers import Answer
from services.gateway.core.completions import Completions, Slot


def test_a_batch_needs_whole_waves_of_its_longest_request() -> None:
    assert need_s(0, 32, 8, 64.0) == 0.0
    assert need_s(2, 32, 8, 64.0) == 4.0  # one wave: 8 streams share 64 tokens/s
    assert need_s(8, 32, 8, 64.0) == 4.0
    assert need_s(9, 32, 8, 64.0) == 8.0


def test_progress_sends_what_is_not_answered_in_the_files_order() -> None:
    lines = [BatchLine(i, f"c{i}", {"max_tokens": 8 * (i + 1)}) for i in range(3)]
    progress = Progress(lines, {"c1"})
    assert [ln.custom_id for ln in progress.queue] == ["c0", "c2"]
    assert (progress.left, progress.most) == (2, 24)
    progress.answer(lines[0])
    progress.answer(lines[0])  # twice: counted once
    assert progress.left == 1


async def test_a_request_cancelled_before_its_first_piece_gives_its_place_back() -> None:
    owner = cast(Completions, type("Owner", (), {"in_flight": 0, "batch_in_flight": 0})())
    started = asyncio.Event()

    async def never() -> AsyncIterator[TokenChunk]:
        started.set()
        await asyncio.sleep(3600)
        yield cast(Any, None)

    answer = Answer(Slot(owner), 1)
    answer.run(0, never())
    assert owner.in_flight == 1
    opening = asyncio.create_task(answer.open())
    await started.wait()
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)
    assert owner.in_flight == 0
    assert all(task.done() for task in answer.tasks)  # the generation stopped too
