"""The exact reference the online policies are measured against: minimise mean completion
time, solved as a MILP.

Tasks have release times, optional deadlines and memory needs; devices have speeds (work
units per second) and memory; each device runs one task at a time, without preemption.
Formulation (HiGHS via ``scipy.optimize.milp``): x[i,j] assigns task i to device j; S[i] is
its start, C[i] = S[i] + Σ_j p[i,j]·x[i,j]; for each pair (i, k) and device j, y[i,k] orders
them when both are on j (big-M disjunction). Small instances only (≤ ~12 tasks × 5 devices).
``list_schedule`` evaluates any online policy on the same model for comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp


@dataclass(frozen=True, slots=True)
class Job:
    release: float
    work: float
    memory_gb: float = 0.0
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Machine:
    speed: float
    memory_gb: float = float("inf")


@dataclass(frozen=True, slots=True)
class Schedule:
    assignment: tuple[int, ...]
    start: tuple[float, ...]
    completion: tuple[float, ...]
    #: False when the solver stopped at its time limit with a feasible, unproven schedule.
    proven_optimal: bool = True

    @property
    def mean_completion(self) -> float:
        return float(np.mean(self.completion))

    def meets_deadlines(self, jobs: Sequence[Job]) -> bool:
        return all(
            j.deadline is None or c <= j.deadline + 1e-6
            for j, c in zip(jobs, self.completion, strict=True)
        )


class Infeasible(ValueError):
    pass


def solve(jobs: Sequence[Job], machines: Sequence[Machine], time_limit_s: float = 30.0) -> Schedule:
    """The optimal schedule. Raises ``Infeasible`` (with the solver's message) if none exists."""
    n, m = len(jobs), len(machines)
    p = np.array([[j.work / mc.speed for mc in machines] for j in jobs])
    horizon = max(j.release for j in jobs) + p.max(axis=1).sum() + 1.0
    pairs = [(i, k) for i in range(n) for k in range(i + 1, n)]
    # Variables: x (n·m), S (n), y (pairs).
    nx, ns, ny = n * m, n, len(pairs)
    size = nx + ns + ny

    def xv(i: int, j: int) -> int:
        return i * m + j

    def sv(i: int) -> int:
        return nx + i

    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(coeffs: dict[int, float], lower: float, upper: float) -> None:
        row = np.zeros(size)
        for index, value in coeffs.items():
            row[index] += value
        rows.append(row)
        lo.append(lower)
        hi.append(upper)

    for i in range(n):
        add({xv(i, j): 1.0 for j in range(m)}, 1.0, 1.0)  # assigned exactly once
        deadline = jobs[i].deadline
        if deadline is not None:  # S_i + Σ p_ij x_ij ≤ D_i
            add({sv(i): 1.0, **{xv(i, j): p[i, j] for j in range(m)}}, -np.inf, deadline)
    big = horizon
    for pair_index, (i, k) in enumerate(pairs):
        y = nx + ns + pair_index
        for j in range(m):
            # i before k on j: S_k ≥ S_i + p_ij − M(1 − y) − M(2 − x_ij − x_kj)
            add(
                {sv(k): 1.0, sv(i): -1.0, y: -big, xv(i, j): -big, xv(k, j): -big},
                p[i, j] - 3 * big,
                np.inf,
            )
            # k before i on j: S_i ≥ S_k + p_kj − M·y − M(2 − x_ij − x_kj)
            add(
                {sv(i): 1.0, sv(k): -1.0, y: big, xv(i, j): -big, xv(k, j): -big},
                p[k, j] - 2 * big,
                np.inf,
            )

    lower = np.zeros(size)
    upper = np.ones(size)
    for i, job in enumerate(jobs):
        lower[sv(i)], upper[sv(i)] = job.release, horizon
        for j, machine in enumerate(machines):
            if job.memory_gb > machine.memory_gb:
                upper[xv(i, j)] = 0.0
    cost = np.zeros(size)
    for i in range(n):
        cost[sv(i)] = 1.0 / n
        for j in range(m):
            cost[xv(i, j)] = p[i, j] / n
    integrality = np.ones(size)
    integrality[nx : nx + ns] = 0
    result = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=Bounds(lower, upper),
        options={"time_limit": time_limit_s},
    )
    if result.x is None:
        raise Infeasible(result.message)
    x = result.x
    assignment = tuple(int(np.argmax([x[xv(i, j)] for j in range(m)])) for i in range(n))
    start = tuple(float(x[sv(i)]) for i in range(n))
    completion = tuple(start[i] + p[i, assignment[i]] for i in range(n))
    return Schedule(assignment, start, completion, proven_optimal=result.status == 0)


Chooser = Callable[[int, float, Sequence[float]], int]
"""``choose(job_index, now, backlog_s_per_machine) -> machine index``."""


def list_schedule(jobs: Sequence[Job], machines: Sequence[Machine], choose: Chooser) -> Schedule:
    """Online list scheduling: jobs in release order, each sent at its release to the machine
    ``choose`` names, run FCFS without preemption. ``backlog`` is each machine's remaining busy
    time at that moment (seconds)."""
    free_at = [0.0] * len(machines)
    assignment = [0] * len(jobs)
    start = [0.0] * len(jobs)
    completion = [0.0] * len(jobs)
    for i in sorted(range(len(jobs)), key=lambda i: (jobs[i].release, i)):
        now = jobs[i].release
        j = choose(i, now, [max(0.0, f - now) for f in free_at])
        assignment[i] = j
        start[i] = max(now, free_at[j])
        completion[i] = start[i] + jobs[i].work / machines[j].speed
        free_at[j] = completion[i]
    return Schedule(tuple(assignment), tuple(start), tuple(completion))
