"""The interface every placement policy implements, and the shared batch loop."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from libs.core.fleet_state import FleetState
from libs.core.model import Placement, Task
from libs.core.pipeline import Pipeline


class Policy(Protocol):
    """Places the tasks of one decision cycle on a fleet, updating the fleet as it goes."""

    name: str

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]: ...


Chooser = Callable[[Task, np.ndarray], tuple[int | None, float]]
Picker = Callable[[Task], tuple[int | None, float]]
Observer = Callable[[Placement, float], None]
"""Called after each decision with the placement and the seconds it took (for metrics)."""


#: Per pipeline, the fleet it last placed on and that fleet's version when it finished: a
#: fleet changed only by that pipeline's own placements (each refreshed as it went) needs no
#: new ``prepare`` (a fleet of 100,000 devices takes ~45 ms to prepare).
_PREPARED: weakref.WeakKeyDictionary[Pipeline, tuple[weakref.ref[FleetState], int]] = (
    weakref.WeakKeyDictionary()
)


def _prepare(pipeline: Pipeline, fleet: FleetState) -> None:
    """``pipeline.prepare(fleet)``, unless the pipeline is current with the fleet: it was the
    last to place on it and nothing has changed the fleet since (its ``version``)."""
    last = _PREPARED.get(pipeline)
    if (
        last is not None
        and pipeline.fleet is fleet
        and last[0]() is fleet
        and last[1] == fleet.version
    ):
        return
    pipeline.prepare(fleet)


def place_in_order(
    pipeline: Pipeline,
    fleet: FleetState,
    ordered: Sequence[Task],
    choose: Chooser,
    observer: Observer | None = None,
) -> list[Placement]:
    """Place ``ordered`` one by one: ``choose(task, feasible_mask)`` picks a device index.

    Infeasible tasks get a placement with the rejection reasons; each placed task updates the
    fleet (and the pipeline's static parts for that device) before the next is decided.
    The clock is read only to report decision times; it never affects a decision.
    """

    def pick(task: Task) -> tuple[int | None, float]:
        feasible = pipeline.feasible(task)
        return choose(task, feasible) if feasible.any() else (None, 0.0)

    return place_each(pipeline, fleet, ordered, pick, observer)


def place_each(
    pipeline: Pipeline,
    fleet: FleetState,
    ordered: Sequence[Task],
    pick: Picker,
    observer: Observer | None = None,
) -> list[Placement]:
    """``place_in_order`` for a policy that finds a task's device itself (``pick(task)``:
    an index and score, or None), without a feasibility mask over the whole fleet."""
    _prepare(pipeline, fleet)
    placements = []
    for task in ordered:
        started = time.perf_counter()
        index, score = pick(task)
        if index is None:
            placement = Placement(task.task_id, None, reason=pipeline.why_not(task))
        else:
            fleet.assign(index, task)
            pipeline.refresh(index)
            placement = Placement(task.task_id, fleet.ids[index], score=score)
        placements.append(placement)
        if observer is not None:
            observer(placement, time.perf_counter() - started)
    _PREPARED[pipeline] = (weakref.ref(fleet), fleet.version)
    return placements


def in_input_order(tasks: Sequence[Task], decided: Sequence[Placement]) -> list[Placement]:
    """``decided`` (in decision order) rearranged to the order the tasks were given in."""
    by_id = {p.task_id: p for p in decided}
    return [by_id[t.task_id] for t in tasks]
