"""Job policies run on a trace: ``JobSimulation(policy, cloud_gpus, edge).run(trace, profiles)``.

Policies, as the ElasticFlow paper and its simulator define them (``libs/sim/round_policies.py``,
run in slot-merged rounds by ``libs/sim/slotted.py``): ``elasticflow`` (admission control,
minimum satisfactory shares, leftover GPUs by marginal gain), ``edgeflow`` (that ElasticFlow's
cloud, untouched, and the edge for the arrivals it declines: never below it), ``edgeflow-each``
(the seed's rules 1–3 with each arrival decided on its own, ``libs/core/edgeflow.py``), ``edf``,
``tiresias``, and ``gandiva`` (node sets by GPU class, packing and time-slicing, in its own
loop: ``libs/sim/gandiva.py``). Also ``elasticflow-each``: ElasticFlow whose admission, when a
slot's arrivals do not fit together, decides each on its own (EdgeFlow's admission without the
edge: what of EdgeFlow's gain is not the edge's). And ``elasticflow-noadmit``: the earlier
continuous variant without admission control (rounds at every arrival and completion, no slot,
5 s per placement change: ``libs/core/edgeflow.allocate`` without the edge), run here, kept to
show what admission control is worth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.core.edgeflow import MIGRATE_EDGE_S, DlJob, EdgeServer, allocate
from libs.sim.gandiva import run_gandiva
from libs.sim.jobs import (
    JOB_POLICIES,
    MODEL_MEMORY_GB,
    JobResult,
    JobState,
    MissingProfile,
    Profile,
    TraceJob,
    curve,
)
from libs.sim.round_policies import run_policy

#: Seconds a job loses moving between two allocations in the cloud.
MIGRATE_CLOUD_S = 5.0


@dataclass
class JobSimulation:
    """``policy`` on ``cloud_gpus`` GPUs and ``edge`` servers; the slotted policies schedule
    every ``slot_s`` seconds at most (ElasticFlow's testbed: 240 s)."""

    policy: str
    cloud_gpus: int
    edge: Sequence[EdgeServer] = ()
    edge_speed: dict[str, float] = field(default_factory=dict)
    slot_s: float = 240.0

    def __post_init__(self) -> None:
        if self.policy not in JOB_POLICIES:
            raise ValueError(
                f"unknown job policy {self.policy!r}; known: {', '.join(JOB_POLICIES)}"
            )
        self.edge_speed = {e.server_id: e.speed for e in self.edge}

    def decide(self, active: list[JobState], now: float) -> dict[str, tuple[str, int]]:
        """The continuous variant's round (``elasticflow-noadmit``)."""
        jobs = [
            DlJob(
                s.trace.job_id,
                s.trace.iterations - s.done,
                s.trace.deadline_s,
                s.curve,
                MODEL_MEMORY_GB.get(s.trace.model, 8.0),
                s.placement[0][5:] if s.placement[0].startswith("edge:") else None,
            )
            for s in active
        ]
        result = allocate(jobs, self.cloud_gpus, (), now, MIGRATE_EDGE_S)
        return {j: ("cloud", g) for j, g in result.cloud_gpus.items()}

    def run(self, trace: Sequence[TraceJob], profiles: Mapping[str, Profile]) -> JobResult:
        """Run ``trace`` to the end. Raises ``MissingProfile`` when a job's model has no
        throughput profile in ``profiles``."""
        missing = sorted({t.model for t in trace} - set(profiles))
        if missing:
            raise MissingProfile(missing, sorted(profiles))
        if self.policy == "gandiva":  # its own loop: no round at a job's end, as theirs
            return run_gandiva(trace, profiles, self.cloud_gpus, self.slot_s)
        if self.policy != "elasticflow-noadmit":
            return run_policy(self.policy, self.cloud_gpus, self.edge, self.slot_s, trace, profiles)
        states = [JobState(t, curve(profiles[t.model], t.batch_size)) for t in trace]
        pending = sorted(states, key=lambda s: s.trace.submit_s)
        active: list[JobState] = []
        now, migration_s, index = 0.0, 0.0, 0
        while index < len(pending) or active:
            while index < len(pending) and pending[index].trace.submit_s <= now + 1e-9:
                active.append(pending[index])
                index += 1
            decision = self.decide(active, now)
            for state in active:
                new = decision.get(state.trace.job_id, ("none", 0))
                if new != state.placement:
                    if state.placement[0] != "none" and new[0] != "none":
                        cost = MIGRATE_CLOUD_S if new[0] == state.placement[0] else MIGRATE_EDGE_S
                        state.paused_until, state.migrations = now + cost, state.migrations + 1
                        migration_s += cost
                    state.placement = new
            # Next event: an arrival or the earliest completion under this allocation.
            next_at = pending[index].trace.submit_s if index < len(pending) else math.inf
            for state in active:
                rate = state.rate(self.edge_speed)
                if rate > 0:
                    start = max(now, state.paused_until)
                    next_at = min(next_at, start + (state.trace.iterations - state.done) / rate)
            if next_at == math.inf:
                break  # nothing can run: the remaining jobs never finish
            for state in active:
                rate = state.rate(self.edge_speed)
                run_s = max(0.0, next_at - max(now, state.paused_until))
                state.done = min(state.trace.iterations, state.done + rate * run_s)
                state.attained_gpu_s += run_s * state.placement[1]
                if state.done >= state.trace.iterations - 1e-6:
                    state.finished_s = next_at
            active = [s for s in active if math.isnan(s.finished_s)]
            now = next_at
        return JobResult(states, migration_s, now)
