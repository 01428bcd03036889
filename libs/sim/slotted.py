"""Scheduling rounds merged into slots, as ElasticFlow's simulator runs every policy
(pkusys/ElasticFlow, ``scheduler.py``: the event loops ``ef_sim_jobs_access_control``,
``one_queue_edf_sim_jobs``, ``dlas_sim_jobs``).

A round runs at an arrival or a completion (a job ending on an edge server only where the
policy asks: EdgeFlow's does not, so its cloud runs round for round as ElasticFlow's), but
never sooner than one slot (240 s) after the previous round: events inside the slot wait for
its end and are handled together (their loops move such events to ``cur_time +
scheduling_slot`` and merge them). Between rounds a job runs at its allocation's measured
throughput, after the overhead the policy charged it this round; a job finishing inside a
slot keeps its GPUs until the slot ends. A declined job never runs and
counts as missed.

The policies themselves are in ``libs/sim/round_policies.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libs.core.edgeflow import MIGRATE_EDGE_S
from libs.sim.jobs import JobResult, JobState, Profile, TraceJob, curve


@dataclass
class Decision:
    """One round's outcome: where each job runs (("cloud", gpus), ("edge:<id>", 1); absent:
    waits), the arrivals declined, each job's overhead this round (s), and when the policy
    wants its next round at the latest (e.g. a Tiresias queue change)."""

    placements: dict[str, tuple[str, int]]
    declined: set[str] = field(default_factory=set)
    overhead_s: dict[str, float] = field(default_factory=dict)
    next_round_s: float = math.inf


class RoundPolicy(Protocol):
    def round(
        self, active: list[JobState], arrivals: list[JobState], now: float, round_no: int
    ) -> Decision: ...


def run_rounds(
    policy: RoundPolicy,
    trace: Sequence[TraceJob],
    profiles: Mapping[str, Profile],
    edge_speed: Mapping[str, float],
    slot_s: float,
    rates: Mapping[str, dict[int, float]] | None = None,
) -> JobResult:
    """Run ``trace`` under ``policy`` to the end. ``rates`` replaces a job's throughput curve
    (Tiresias runs a job at its trace duration, as their simulator does)."""
    states = [
        JobState(t, (rates or {}).get(t.job_id) or curve(profiles[t.model], t.batch_size))
        for t in trace
    ]
    pending = sorted(states, key=lambda s: (s.trace.submit_s, s.trace.job_id))
    active: list[JobState] = []
    index, round_no, migration_s = 0, 0, 0.0
    now = last = pending[0].trace.submit_s if pending else 0.0
    while index < len(pending) or active:
        for state in active:
            advance(state, last, now, edge_speed)
        active = [s for s in active if math.isnan(s.finished_s)]
        arrivals = []
        while index < len(pending) and pending[index].trace.submit_s <= now + 1e-9:
            arrivals.append(pending[index])
            index += 1
        decision = policy.round(active, arrivals, now, round_no)
        round_no += 1
        for state in arrivals:
            if state.trace.job_id in decision.declined:
                state.declined = True
            else:
                active.append(state)
        for state in active:
            new = decision.placements.get(state.trace.job_id, ("none", 0))
            pause = decision.overhead_s.get(state.trace.job_id, 0.0) if new[1] else 0.0
            old_kind, new_kind = kind(state.placement), kind(new)
            if old_kind != "none" and new_kind != "none" and old_kind != new_kind:
                pause += MIGRATE_EDGE_S
                migration_s += MIGRATE_EDGE_S
                state.migrations += 1
            state.placement, state.paused_until = new, now + pause
        upcoming = pending[index].trace.submit_s if index < len(pending) else math.inf
        upcoming = min(upcoming, decision.next_round_s)
        # A job ending on the edge starts a round only where the policy asks, or when
        # nothing else is left to happen (no arrival, no cloud job running).
        wakes, edge_ends = getattr(policy, "edge_ends_wake", True), [math.inf]
        for state in active:
            rate = state.rate(edge_speed)
            if rate > 0:
                end = state.paused_until + (state.trace.iterations - state.done) / rate
                if wakes or kind(state.placement) != "edge":
                    upcoming = min(upcoming, end)
                else:
                    edge_ends.append(end)
        if upcoming == math.inf:
            upcoming = min(edge_ends)
        if upcoming == math.inf:
            break  # nothing runs and nothing arrives: the rest never finish
        last, now = now, max(upcoming, now + slot_s)
    return JobResult(states, migration_s, now, dict(getattr(policy, "counts", {})))


def kind(placement: tuple[str, int]) -> str:
    where = placement[0]
    return "edge" if where.startswith("edge:") else where


def advance(state: JobState, start: float, end: float, edge_speed: Mapping[str, float]) -> None:
    """Run ``state`` from ``start`` to ``end`` (after its pause); note when it finishes."""
    rate = state.rate(edge_speed)
    if rate <= 0:
        return
    begin = max(start, state.paused_until)
    run_s = max(0.0, end - begin)
    need_s = (state.trace.iterations - state.done) / rate
    if need_s <= run_s + 1e-9:
        state.done, state.finished_s = state.trace.iterations, begin + need_s
        run_s = need_s
    else:
        state.done += rate * run_s
    state.attained_gpu_s += run_s * state.placement[1]
