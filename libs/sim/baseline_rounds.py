"""The baseline job policies of the slotted simulator, as ElasticFlow's paper and simulator
define them (``libs/sim/round_policies.py`` runs them beside ElasticFlow and EdgeFlow):

* ``EdfRounds`` — EDF (``one_queue_edf_sim_jobs``): earliest deadline first, each job up to
  min(64, batch size, largest profiled count) GPUs, re-planned every round, no admission, no
  overhead charged (their EDF sets it to 0).
* ``TiresiasRounds`` — Tiresias (``dlas_sim_jobs(gputime=True)``): discretised 2D-LAS, three
  queues split at 3,250 and 7,200 GPU-seconds attained, FIFO within a queue, first fit, the
  trace's GPU count and duration, a start overhead when a job (re)starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from libs.core.elasticflow import baseline_max_gpu, overhead_s
from libs.sim.jobs import JobState, restarting
from libs.sim.slotted import Decision


@dataclass
class EdfRounds:
    cloud_gpus: int

    def round(
        self, active: list[JobState], arrivals: list[JobState], now: float, round_no: int
    ) -> Decision:
        free, placements = self.cloud_gpus, {}
        for state in sorted(
            active + arrivals, key=lambda s: (s.trace.deadline_s, s.trace.submit_s)
        ):
            cap = baseline_max_gpu(state.curve, state.trace.batch_size)
            fits = [g for g in state.curve if g <= min(cap, free)]
            if fits:
                gpus = max(fits)
                placements[state.trace.job_id] = ("cloud", gpus)
                free -= gpus
        return Decision(placements)


#: Tiresias' queue limits in attained GPU-seconds (their ``jobs.py``: 3,250 and 7,200).
TIRESIAS_LIMITS = (3250.0, 7200.0)


@dataclass
class TiresiasRounds:
    cloud_gpus: int
    queues: list[list[JobState]] = field(default_factory=lambda: [[], [], []])

    def round(
        self, active: list[JobState], arrivals: list[JobState], now: float, round_no: int
    ) -> Decision:
        live = {id(s) for s in active} | {id(s) for s in arrivals}
        self.queues = [[s for s in q if id(s) in live] for q in self.queues]
        # A running job that attained its queue's limit moves down one queue, to its end.
        for level in range(len(TIRESIAS_LIMITS) - 1, -1, -1):
            for state in list(self.queues[level]):
                if state.placement[1] and state.attained_gpu_s >= TIRESIAS_LIMITS[level]:
                    self.queues[level].remove(state)
                    self.queues[level + 1].append(state)
        self.queues[0].extend(arrivals)
        free, placements, overhead = self.cloud_gpus, {}, {}
        restart = restarting(round_no)
        for queue in self.queues:
            for state in queue:
                gpus = state.trace.gpus
                if 0 < gpus <= free:
                    free -= gpus
                    placements[state.trace.job_id] = ("cloud", gpus)
                    if restart or not state.placement[1]:
                        overhead[state.trace.job_id] = overhead_s(
                            gpus, rescaled=True, restart=restart, cluster_gpus=self.cloud_gpus
                        )
        # Jobs left waiting go to the end of their queue (their loop re-appends them).
        for i, queue in enumerate(self.queues):
            self.queues[i] = [s for s in queue if s.trace.job_id in placements] + [
                s for s in queue if s.trace.job_id not in placements
            ]
        next_round = math.inf
        for level, queue in enumerate(self.queues[: len(TIRESIAS_LIMITS)]):
            for state in queue:
                gpus = placements.get(state.trace.job_id, ("none", 0))[1]
                if gpus:
                    left = TIRESIAS_LIMITS[level] - state.attained_gpu_s
                    start = now + overhead.get(state.trace.job_id, 0.0)
                    next_round = min(next_round, start + max(0.0, left) / gpus)
        return Decision(placements, set(), overhead, next_round)
