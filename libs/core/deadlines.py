"""Admission of work with deadlines run one after the other: earliest deadline first, or in
another order (first come, first served).

A batch of requests needs an estimated number of seconds of the model's serving (its tokens
at the throughput measured for that model); the batches admitted before it run in the order
given (their deadlines unless told). A new batch is admitted only when, with it inserted in
that order, it and every batch already admitted still end before their deadlines; otherwise
it is declined at once with the reason, and nothing of it is queued. Pure: ``now`` is passed
in. ``batch_policies.py`` builds the Batch API's live policies on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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


def by_deadline(work: Work) -> Any:
    return (work.deadline_s, work.job_id)


def edf_finishes(
    works: Sequence[Work], now: float, order: Callable[[Work], Any] = by_deadline
) -> dict[str, float]:
    """When each work ends if all run one after the other, earliest deadline first (ties by
    id) unless ``order`` says, starting at ``now``."""
    clock, out = now, {}
    for work in sorted(works, key=order):
        clock += max(0.0, work.seconds_left)
        out[work.job_id] = clock
    return out


def admit(
    admitted: Sequence[Work],
    new: Work,
    now: float,
    order: Callable[[Work], Any] = by_deadline,
) -> Admission:
    """Whether ``new`` may join ``admitted`` with every deadline still met, run in ``order``
    (see the module)."""
    if not math.isfinite(new.seconds_left):
        return Admission(False, math.inf, "no throughput measured for its model")
    finishes = edf_finishes([*admitted, new], now, order)
    planned = finishes[new.job_id]
    ahead = sum(w.seconds_left for w in admitted if order(w) < order(new))
    if planned > new.deadline_s:
        window = max(0.0, new.deadline_s - now)
        return Admission(
            False,
            planned,
            f"needs about {span(new.seconds_left)} of serving and its deadline is in "
            f"{span(window)}, of which {span(max(0.0, window - ahead))} is free "
            f"({span(ahead)} taken by batches ahead of it)",
        )
    before = edf_finishes(admitted, now, order)
    for work in admitted:
        if finishes[work.job_id] > work.deadline_s >= before[work.job_id]:
            return Admission(
                False,
                planned,
                f"admitting it (about {span(new.seconds_left)} of serving) would make "
                f"{work.job_id}, admitted before it, miss its deadline",
            )
    return Admission(True, planned, f"planned to end in {span(planned - now)}")


def span(seconds: float) -> str:
    """Seconds as a person reads them: 45 s, 12.5 min, 3.2 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
