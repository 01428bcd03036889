"""EdgeFlow (seed 002): deadline-aware allocation of deep-learning jobs to cloud GPUs and
edge servers, for one scheduling round.

The cloud is ElasticFlow's: (1) each job gets its minimum satisfactory share (the fewest GPUs
that meet its deadline), earliest deadline first, while GPUs last; (2) leftover GPUs go one
step at a time to the job with the largest gain (seconds saved) per extra GPU. The edge only
adds to that, with the seed's three rules made safe (jobs are re-decided at every event, and a
move to or from the edge costs ``migrate_s``):

* rule 1 — jobs on the edge stay there (hysteresis), unless they would miss their deadline
  there and the cloud can now meet it even after the move back;
* rule 2 — not applied: moving jobs that hold GPUs to the edge (even only where they still
  meet their deadline there after the move, and only to start a waiting job) met fewer
  deadlines than ElasticFlow alone on the 195-job trace (0.887 against 0.892) and cluster01
  (0.660–0.668 against 0.671): a job on a slow edge server gives up the leftover GPUs that
  would have finished it early and freed them for later arrivals;
* rule 3 — jobs still waiting for a GPU run on an idle edge server where they meet their
  deadline. (Running the others there too, rather than waiting, also met fewer deadlines on
  the 195-job trace: 0.887.)

The seed's rules as first written — moves re-decided at every event, hopeless jobs sent to the
edge for good — met fewer deadlines than ElasticFlow without the edge on every ITP trace.
Only jobs whose memory fits an edge server go there.
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
    #: The edge server it runs on now (None: in the cloud or waiting).
    edge_server: str | None = None

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


#: Seconds a job loses moving between the cloud and an edge server (checkpoint and restore).
MIGRATE_EDGE_S = 30.0


def allocate(
    jobs: Sequence[DlJob],
    cloud_gpus: int,
    edge: Sequence[EdgeServer],
    now: float,
    migrate_s: float = MIGRATE_EDGE_S,
) -> Allocation:
    share: dict[str, int] = {}
    reasons: dict[str, str] = {}
    on_edge: dict[str, str] = {}
    free = cloud_gpus
    by_deadline = sorted(jobs, key=lambda j: (j.deadline_s, j.job_id))
    servers = {s.server_id: s for s in edge}
    idle = dict(servers)

    def fitting(job: DlJob) -> EdgeServer | None:
        return next((s for s in idle.values() if job.memory_gb <= s.memory_gb), None)

    def to_edge(job: DlJob, server: EdgeServer, reason: str) -> None:
        del idle[server.server_id]
        on_edge[job.job_id] = server.server_id
        reasons[job.job_id] = reason

    # Rule 1: jobs on the edge stay; one that misses there may return in step 1.
    returning: set[str] = set()
    for job in by_deadline:
        server = servers.get(job.edge_server or "")
        if server is None or server.server_id not in idle:
            continue
        to_edge(job, server, "edge rule 1: stays on the edge")
        misses = edge_end_time(job, server, now) > job.deadline_s
        if misses and min_satisfactory_share(job, now + migrate_s) is not None:
            returning.add(job.job_id)

    # Step 1: minimum satisfactory shares, earliest deadline first.
    for job in by_deadline:
        if job.job_id in on_edge and job.job_id not in returning:
            continue
        back = job.job_id in returning
        need = min_satisfactory_share(job, now + migrate_s if back else now)
        if need is not None and need <= free:
            share[job.job_id], free = need, free - need
            reasons[job.job_id] = f"minimum satisfactory share {need}"
            if back:
                idle[on_edge.pop(job.job_id)] = servers[job.edge_server or ""]
                reasons[job.job_id] += " (back from the edge: it misses its deadline there)"

    # Leftover GPUs first start jobs that have none (as ElasticFlow does).
    for job in by_deadline:
        unplaced = job.job_id not in share and job.job_id not in on_edge
        if unplaced and free >= 1 and 1 in job.throughput:
            share[job.job_id], free = 1, free - 1
            reasons[job.job_id] = "leftover GPU"

    # Rule 3: jobs still waiting run on an idle edge server where they meet their deadline.
    for job in by_deadline:
        if job.job_id in share or job.job_id in on_edge:
            continue
        server = fitting(job)
        if server is not None and edge_end_time(job, server, now) <= job.deadline_s:
            to_edge(job, server, "edge rule 3: no GPU free, meets its deadline on the edge")

    # Step 2: leftover GPUs by marginal gain per extra GPU.
    by_id = {j.job_id: j for j in jobs}
    while free > 0:
        best, best_gain, best_step = None, 0.0, 0
        for job_id, gpus in share.items():
            job = by_id[job_id]
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
