"""Admission of work with deadlines on one served model: earliest deadline first.

A batch of requests needs an estimated number of seconds of the model's serving (its tokens
at the throughput measured for that model); the batches admitted before it run earliest
deadline first. A new batch is admitted only when, with it inserted in that order, it and
every batch already admitted still end before their deadlines; otherwise it is declined at
once with the reason, and nothing of it is queued. Pure: ``now`` is passed in.

This is the live policy of the gateway's Batch API (``services/gateway/batches``); seed 002's
EdgeFlow over several devices (``edgeflow.py``) runs in the simulator only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Work:
    job_id: str
    #: Estimated seconds of serving still needed.
    seconds_left: float
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    #: When the new work is planned to end (inf when it cannot be placed at all).
    planned_finish_s: float
    reason: str


def edf_finishes(works: Sequence[Work], now: float) -> dict[str, float]:
    """When each work ends if all run one after the other, earliest deadline first (ties by
    id), starting at ``now``."""
    clock, out = now, {}
    for work in sorted(works, key=lambda w: (w.deadline_s, w.job_id)):
        clock += max(0.0, work.seconds_left)
        out[work.job_id] = clock
    return out


def admit(admitted: Sequence[Work], new: Work, now: float) -> Admission:
    """Whether ``new`` may join ``admitted`` with every deadline still met (see the module)."""
    if not math.isfinite(new.seconds_left):
        return Admission(False, math.inf, "no throughput measured for its model")
    finishes = edf_finishes([*admitted, new], now)
    planned = finishes[new.job_id]
    ahead = sum(
        w.seconds_left for w in admitted if (w.deadline_s, w.job_id) < (new.deadline_s, new.job_id)
    )
    if planned > new.deadline_s:
        window = max(0.0, new.deadline_s - now)
        return Admission(
            False,
            planned,
            f"needs about {_span(new.seconds_left)} of serving and its deadline is in "
            f"{_span(window)}, of which {_span(max(0.0, window - ahead))} is free "
            f"({_span(ahead)} taken by batches with earlier deadlines)",
        )
    before = edf_finishes(admitted, now)
    for work in admitted:
        if finishes[work.job_id] > work.deadline_s >= before[work.job_id]:
            return Admission(
                False,
                planned,
                f"admitting it (about {_span(new.seconds_left)} of serving) would make "
                f"{work.job_id}, admitted before it, miss its deadline",
            )
    return Admission(True, planned, f"planned to end in {_span(planned - now)}")


def _span(seconds: float) -> str:
    """Seconds as a person reads them: 45 s, 12.5 min, 3.2 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
