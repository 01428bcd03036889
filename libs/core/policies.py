"""Policy names → implementations. The live scheduler, the simulator and the CLI all pick
policies by these names."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from libs.contracts import Mode
from libs.contracts.profiles import Profile
from libs.core import allocation, balancers
from libs.core.dwps import Dwps
from libs.core.exact import Job, Machine, solve
from libs.core.fleet_state import FleetState
from libs.core.model import Placement, Task
from libs.core.pipeline import Pipeline
from libs.core.policy import Policy
from libs.core.profiles import BUILTIN_PROFILES
from libs.core.queued import queued_policy


class ExactPolicy:
    """The MILP optimum of mean completion time for one batch (small batches only)."""

    name = "ilp"
    max_tasks = 12

    def __init__(self) -> None:
        self.pipeline = Pipeline(BUILTIN_PROFILES[Mode.BALANCED])

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        if len(tasks) > self.max_tasks:
            raise ValueError(f"ilp places at most {self.max_tasks} tasks per batch")
        self.pipeline.prepare(fleet)
        usable = [i for i in range(len(fleet)) if self.pipeline.static_mask[i]]
        jobs = [Job(max(t.release, now), t.work, t.memory_gb, t.deadline) for t in tasks]
        machines = [Machine(float(fleet.speed[i]), float(fleet.memory_free_gb[i])) for i in usable]
        if not machines:
            return [Placement(t.task_id, None, reason="no usable device") for t in tasks]
        schedule = solve(jobs, machines)
        placements = []
        for task, machine in zip(tasks, schedule.assignment, strict=True):
            index = usable[machine]
            fleet.assign(index, task)
            placements.append(Placement(task.task_id, fleet.ids[index]))
        return placements


def _dwps(profile: Profile | None) -> Policy:
    return Dwps(profile)


POLICIES: dict[str, Callable[[Profile | None], Policy]] = {
    "dwps": _dwps,
    "random": lambda _: balancers.RandomBalancer(),
    "round_robin": lambda _: balancers.RoundRobin(),
    "weighted_round_robin": lambda _: balancers.WeightedRoundRobin(),
    "least_connections": lambda _: balancers.LeastConnections(),
    "power_of_two": lambda _: balancers.PowerOfTwo(),
    "source_hash": lambda _: balancers.SourceHash(),
    "consistent_hash": lambda _: balancers.ConsistentHash(),
    "fcfs": lambda _: queued_policy("fcfs"),
    "sjf": lambda _: queued_policy("sjf"),
    "priority": lambda _: queued_policy("priority"),
    "round_robin_slice": lambda _: queued_policy("round_robin_slice"),
    "mlfq": lambda _: queued_policy("mlfq"),
    "static": lambda _: allocation.StaticAllocation(),
    "dynamic": lambda _: allocation.DynamicAllocation(),
    "priority_allocation": lambda _: allocation.PriorityAllocation(),
    "market": lambda _: allocation.Market(),
    "fair_share": lambda _: allocation.FairShare(),
    "ilp": lambda _: ExactPolicy(),
}


def make_policy(name: str, profile: Profile | None = None) -> Policy:
    """A fresh policy object (policies keep per-run state such as cursors and usage)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise KeyError(f"unknown policy {name!r}; known: {known}") from None
    return factory(profile)
