"""A training run of a batch (``TRAIN_ENDPOINT``, made by ``tessera jobs submit --train``), run
by the batch worker itself rather than sent to the gateway.

The body names the run (``run``: the runner draws it from the batch and the line, so each
attempt at the same line trains the same checkpoint), its ``steps``, how often it checkpoints
(``every``) and its ``seed``. The run resumes from its last checkpoint, wherever that was
written (``TESSERA_BATCH_CHECKPOINT_DIR``: storage every batch worker shares), and ends early,
checkpointed, when the runner stops it (preempted by a chat, cancelled, or given up): that
attempt answers 503 and the runner sends the run again later, to resume where it stopped.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.contracts.batch_requests import TRAIN_MODEL, Answer
from services.batch.training import train

log = logging.getLogger(__name__)

_RUN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
#: How often a run reports its step (s).
REPORT_EVERY_S = 1.0


def train_run(
    body: dict[str, Any],
    checkpoint_dir: Path,
    device_id: str,
    stop: Callable[[], bool],
    report: Callable[[str, int], None] = lambda run, step: None,
) -> Answer:
    """The run trained to its steps (200, with the result), or why not; ``report(run, step)``
    about once a second while it trains (the job's progress)."""
    run = str(body.get("run", ""))
    if not _RUN.match(run):
        return 400, {"error": {"message": f"run {run!r} is not a name a checkpoint can take"}}, []
    reported = [0.0]

    def on_step(step: int) -> None:
        if time.monotonic() - reported[0] >= REPORT_EVERY_S:
            reported[0] = time.monotonic()
            report(run, step)

    try:
        result = train(
            run,
            int(body["steps"]),
            checkpoint_dir,
            device_id=device_id,
            attempt=time.time_ns(),  # a later attempt is a newer one
            every=int(body.get("every", 10)),
            seed=int(body.get("seed", 0)),
            stop=stop,
            on_step=on_step,
        )
    except (KeyError, TypeError, ValueError) as exc:
        return 400, {"error": {"message": f"not a training run: {exc!r}"}}, []
    except Exception as exc:  # a checkpoint unreadable, a disk full: the runner tries again
        log.exception("training run failed", extra={"run": run})
        return 500, {"error": {"message": f"training failed: {exc!r}"}}, [device_id]
    report(run, result.final_step)
    if result.stopped or result.superseded:
        why = "stopped" if result.stopped else "superseded by a newer attempt"
        message = f"{why} at step {result.final_step}; it resumes from its checkpoint"
        return 503, {"error": {"message": message}}, [device_id]
    checkpoint = checkpoint_dir / f"{run}.pt"
    if not body.get("keep", True):  # a sample run, measuring the rate: nothing to keep
        checkpoint.unlink(missing_ok=True)
    answer = {
        "id": f"trainrun-{run}",
        "object": "tessera.training_run",
        "model": TRAIN_MODEL,
        "steps": result.final_step,
        "resumed_from": result.resumed_from,
        "loss": result.loss,
        "weights_sha256": result.weights_sha256,
        "checkpoint": str(checkpoint) if body.get("keep", True) else None,
        "device": device_id,
        "usage": {"steps": result.final_step - result.resumed_from},
    }
    return 200, answer, [device_id]
