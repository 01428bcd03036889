"""A training job's progress in training steps: its runs are long, so a count of the runs
answered says little while they train. Each run's last step as its worker reported it
(``CelerySender.steps``), the runs answered counted whole, written to the batch as
``steps_done`` (of ``steps_total``: ``training`` in the Batch object, the bar of ``tessera jobs
submit --train --wait``)."""

from __future__ import annotations

import math
import time
from typing import Any

from services.gateway.batches.lines import Progress, run_name
from services.gateway.batches.sender import Send
from services.gateway.batches.store import JobStore

#: Seconds between two writings of a job's steps.
EVERY_S = 1.0


async def write_steps(
    store: JobStore,
    send: Send,
    batch: dict[str, Any],
    progress: Progress,
    last: dict[str, float] | None = None,
) -> None:
    """The steps ``batch``'s runs have made, written where they changed; with ``last`` (when
    each batch's were last written), at most once a second."""
    reported = getattr(send, "steps", None)
    if reported is None:  # a sender that trains nothing
        return
    if last is not None:
        if time.monotonic() - last.get(batch["id"], -math.inf) < EVERY_S:
            return
        last[batch["id"]] = time.monotonic()
    running = [ln for ln in progress.lines if ln.custom_id not in progress.answered]
    now = await reported([run_name(batch["id"], ln.custom_id) for ln in running])
    done = sum(ln.token_budget for ln in progress.lines if ln.custom_id in progress.answered)
    done += sum(min(step or 0, ln.token_budget) for ln, step in zip(running, now, strict=True))
    if done != batch.get("steps_done"):
        await store.update(batch["id"], steps_done=done)
