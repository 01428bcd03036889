"""Resource-allocation policies: static, dynamic, priority, market, fair share."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from libs.contracts import Mode
from libs.core.balancers import Balancer
from libs.core.capability import total_score
from libs.core.fleet_state import FleetState
from libs.core.model import Placement, Task, TaskKind
from libs.core.policy import Chooser, in_input_order, place_in_order
from libs.core.profiles import BUILTIN_PROFILES

_KINDS = list(TaskKind)


def _capability_total(fleet: FleetState) -> np.ndarray:
    return total_score(fleet.capability, BUILTIN_PROFILES[Mode.BALANCED].dimensions.as_tuple())


class StaticAllocation(Balancer):
    """Devices are split among task kinds up front (device i serves kind i mod 3); tasks go
    round robin within their kind's share, whatever the load. Falls back to any feasible
    device when the kind's share has none."""

    name = "static"

    def __init__(self) -> None:
        super().__init__()
        self.cursor: dict[TaskKind, int] = defaultdict(lambda: -1)

    def chooser(self, fleet: FleetState) -> Chooser:
        owner = np.arange(len(fleet)) % len(_KINDS)

        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            mine = feasible & (owner == _KINDS.index(task.kind))
            candidates = np.flatnonzero(mine if mine.any() else feasible)
            after = candidates[candidates > self.cursor[task.kind]]
            pick = int(after[0] if len(after) else candidates[0])
            self.cursor[task.kind] = pick
            return pick, 0.0

        return choose


class DynamicAllocation(Balancer):
    """On demand, by current state: the device that would finish the task earliest."""

    name = "dynamic"

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            finish = (fleet.load * fleet.slots + 1.0) * max(task.work, 1e-9) / fleet.speed
            return int(np.argmin(np.where(feasible, finish, np.inf))), 0.0

        return choose


class PriorityAllocation(Balancer):
    """Highest-priority tasks first, each to the most capable feasible device."""

    name = "priority_allocation"

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        ordered = sorted(tasks, key=lambda t: (-t.priority, -t.urgency, t.release))
        decided = place_in_order(self.pipeline, fleet, ordered, self.chooser(fleet))
        return in_input_order(tasks, decided)

    def chooser(self, fleet: FleetState) -> Chooser:
        capability = _capability_total(fleet)

        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            return int(np.argmax(np.where(feasible, capability, -np.inf))), 0.0

        return choose


class Market(Balancer):
    """Tasks bid; a device's price is its capability × (1 + load). Highest bids buy first,
    each the feasible device with the most speed per unit price it can afford; a task whose
    bid is below every price waits (unplaced, with that reason)."""

    name = "market"

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        ordered = sorted(tasks, key=lambda t: (-t.bid, t.release))
        decided = place_in_order(self.pipeline, fleet, ordered, self.chooser(fleet))
        return in_input_order(tasks, decided)

    def chooser(self, fleet: FleetState) -> Chooser:
        capability = _capability_total(fleet)

        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            price = np.maximum(capability, 1e-6) * (1.0 + fleet.load)
            affordable = feasible & (price <= task.bid)
            if not affordable.any():
                return None, 0.0
            value = np.where(affordable, fleet.speed / price, -np.inf)
            best = int(np.argmax(value))
            return best, float(price[best])

        return choose


class FairShare(Balancer):
    """Sources take turns by attained service: the source that has used least goes first,
    then the least-loaded feasible device. Usage (work placed) is remembered across cycles."""

    name = "fair_share"

    def __init__(self) -> None:
        super().__init__()
        self.usage: dict[str, float] = defaultdict(float)

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        pending = list(tasks)
        ordered: list[Task] = []
        projected = dict(self.usage)
        while pending:
            task = min(pending, key=lambda t: (projected.get(t.source, 0.0), t.release))
            pending.remove(task)
            ordered.append(task)
            projected[task.source] = projected.get(task.source, 0.0) + task.work
        decided = place_in_order(self.pipeline, fleet, ordered, self.chooser(fleet))
        for task, placement in zip(ordered, decided, strict=True):
            if placement.placed:
                self.usage[task.source] += task.work
        return in_input_order(tasks, decided)

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            return int(np.argmin(np.where(feasible, fleet.load, np.inf))), 0.0

        return choose
