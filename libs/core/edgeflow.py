"""EdgeFlow (seed 002): deadline-aware allocation of deep-learning jobs to cloud GPUs and
edge servers, for one scheduling round.

1. Minimum satisfactory share: each job gets the fewest GPUs that meet its deadline, earliest
   deadline first, while GPUs last.
2. Leftover cloud GPUs go, one step at a time, to the job with the largest gain (seconds of
   completion time saved) per extra GPU.
3. Offload to idle edge servers, only jobs whose memory fits the edge server:
   (1) jobs already on the edge stay there;
   (2) jobs that still meet their deadline on the slower edge go there, but only if the cloud
       has no spare GPUs;
   (3) if edge servers remain, the jobs least able to meet their deadline even with one more
       GPU go there, ranked by priority_i = ddl_i − end_time(i, one more GPU) (lowest first),
       freeing their cloud GPUs for jobs that can be saved.
Pure: ``now`` is passed in; throughput comes from measured scaling curves (iterations/s by GPU
count), which are sub-linear.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DlJob:
    job_id: str
    remaining_iterations: float
    deadline_s: float
    #: Iterations/s by GPU count (e.g. {1: 6.0, 2: 8.6, 4: 10.4, 8: 11.1}).
    throughput: Mapping[int, float]
    memory_gb: float = 0.0
    on_edge: bool = False

    def end_time(self, now: float, gpus: int) -> float:
        """Completion time with ``gpus`` cloud GPUs (inf with none or an unknown count)."""
        rate = self.throughput.get(gpus, 0.0) if gpus > 0 else 0.0
        return now + self.remaining_iterations / rate if rate > 0 else math.inf

    def next_count(self, gpus: int) -> int | None:
        """The next GPU count of the curve above ``gpus``."""
        larger = sorted(g for g in self.throughput if g > gpus)
        return larger[0] if larger else None


@dataclass(frozen=True, slots=True)
class EdgeServer:
    server_id: str
    memory_gb: float
    #: Speed relative to one cloud GPU (e.g. 0.3 for a T4-class box against an A100).
    speed: float


@dataclass(frozen=True, slots=True)
class Allocation:
    cloud_gpus: dict[str, int]
    edge: dict[str, str]  # job id → edge server id
    waiting: tuple[str, ...]
    reasons: dict[str, str]


def edge_end_time(job: DlJob, server: EdgeServer, now: float) -> float:
    rate = job.throughput.get(1, 0.0) * server.speed
    return now + job.remaining_iterations / rate if rate > 0 else math.inf


def min_satisfactory_share(job: DlJob, now: float) -> int | None:
    for gpus in sorted(job.throughput):
        if job.end_time(now, gpus) <= job.deadline_s:
            return gpus
    return None


def allocate(
    jobs: Sequence[DlJob], cloud_gpus: int, edge: Sequence[EdgeServer], now: float
) -> Allocation:
    share: dict[str, int] = {}
    reasons: dict[str, str] = {}
    free = cloud_gpus
    by_deadline = sorted(jobs, key=lambda j: (j.deadline_s, j.job_id))
    idle_edge = list(edge)
    on_edge: dict[str, str] = {}

    def take_edge(job: DlJob, reason: str) -> bool:
        for server in idle_edge:
            if job.memory_gb <= server.memory_gb:
                idle_edge.remove(server)
                on_edge[job.job_id] = server.server_id
                reasons[job.job_id] = reason
                return True
        return False

    # Rule 1: jobs already on the edge stay there.
    for job in by_deadline:
        if job.on_edge:
            take_edge(job, "edge rule 1: already on the edge")
    # Step 1: minimum satisfactory shares, earliest deadline first.
    for job in by_deadline:
        if job.job_id in on_edge:
            continue
        need = min_satisfactory_share(job, now)
        if need is not None and need <= free:
            share[job.job_id], free = need, free - need
            reasons[job.job_id] = f"minimum satisfactory share {need}"
    # Rule 2: jobs that meet their deadline on the edge go there when the cloud is full.
    if free == 0:
        for job in by_deadline:
            if job.job_id in on_edge or not idle_edge:
                continue
            fitting = [s for s in idle_edge if job.memory_gb <= s.memory_gb]
            if fitting and edge_end_time(job, fitting[0], now) <= job.deadline_s:
                free += share.pop(job.job_id, 0)
                take_edge(job, "edge rule 2: meets its deadline on the edge")

    # Rule 3: jobs least able to meet their deadline even with one more GPU go to the edge.
    def priority(job: DlJob) -> float:
        current = share.get(job.job_id, 0)
        more = job.next_count(current)
        return job.deadline_s - job.end_time(now, more if more is not None else current)

    hopeless = [
        j
        for j in by_deadline
        if j.job_id not in on_edge
        and priority(j) < 0
        and j.memory_gb <= max((s.memory_gb for s in idle_edge), default=-1)
    ]
    for job in sorted(hopeless, key=lambda j: (priority(j), j.job_id)):
        if not idle_edge:
            break
        gpus = share.get(job.job_id, 0)
        if take_edge(job, "edge rule 3: cannot meet its deadline even with one more GPU"):
            free += gpus
            share.pop(job.job_id, None)
    # Step 2: leftover GPUs by marginal gain per extra GPU.
    for job in by_deadline:  # jobs with no share yet can still start with one GPU
        if (
            job.job_id not in share
            and job.job_id not in on_edge
            and free >= 1
            and 1 in job.throughput
        ):
            share[job.job_id], free = 1, free - 1
            reasons[job.job_id] = "leftover GPU"
    while free > 0:
        best, best_gain, best_step = None, 0.0, 0
        for job_id, gpus in share.items():
            job = next(j for j in jobs if j.job_id == job_id)
            more = job.next_count(gpus)
            if more is None or more - gpus > free:
                continue
            gain = (job.end_time(now, gpus) - job.end_time(now, more)) / (more - gpus)
            if gain > best_gain:
                best, best_gain, best_step = job_id, gain, more - gpus
        if best is None:
            break
        share[best] += best_step
        free -= best_step
        reasons[best] = f"elastic share {share[best]} (largest gain per extra GPU)"
    waiting = tuple(
        j.job_id for j in by_deadline if j.job_id not in share and j.job_id not in on_edge
    )
    for job_id in waiting:
        reasons[job_id] = "waiting: no GPU or edge server free"
    return Allocation(share, on_edge, waiting, reasons)
