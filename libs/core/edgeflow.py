"""EdgeFlow: deep-learning jobs with deadlines on cloud GPUs and edge servers.

EdgeFlow runs on ElasticFlow as its authors built it (``libs/core/elasticflow.py``, driven
round by round in ``libs/sim/round_policies.py``) and adds the edge. By default (``edgeflow``)
only for what ElasticFlow declines: the cloud decides as ElasticFlow does, and an arrival it
declines runs on an idle edge server where it meets its deadline (``edge_admission``), and
stays there; so it never meets fewer deadlines than ElasticFlow. The seed's full rules, which
change the cloud's decisions and can meet fewer (``edgeflow-each``):

* in admission — when a slot's arrivals do not fit the cloud together, each is decided on its
  own, earliest deadline first: the cloud when every deadline still holds with it; else an idle
  edge server where it meets its deadline and its memory fits (``edge_admission``); else the
  cloud with an idle server kept for the end of a cloud job (rule 2 below, made safe: the
  job moves only once the server can finish it by its deadline); else it is declined alone;
* rule 1 — jobs on the edge stay there, unless they would miss their deadline there and the
  cloud can still meet it after the 30 s move back;
* rule 2 — jobs left without a GPU run on an idle edge server where they meet their deadline;
* rule 3 — with servers still idle, the cloud jobs least able to meet their deadline (priority
  = deadline − end with one more GPU step, below 0) go to the edge, lowest first, and their
  GPUs go to the jobs that stay.

Moving every job that would still meet its deadline on the edge there, as soon as a server is
idle (rule 2 as first designed), met fewer deadlines than ElasticFlow alone (195job −0.51
points, cluster01 −8.21 and −0.06): what it changes in ElasticFlow's admission decisions costs
more than the edge adds.

``allocate`` is the earlier continuous round (no admission control, rounds at every event) that
``elasticflow-noadmit`` runs without the edge. Pure: ``now`` is passed in; throughput comes
from measured scaling curves (iterations/s by GPU count), which are sub-linear.
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
    """One round of the continuous variant: minimum satisfactory shares earliest deadline
    first while GPUs last, leftover GPUs first to jobs without one, then one step at a time to
    the largest gain (seconds saved) per extra GPU; with ``edge`` servers, rules 1 and 3 as
    above (rule 2 not applied: in this variant it met fewer deadlines, 195job 0.887 against
    0.892). No admission control: every job is scheduled."""
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


@dataclass(frozen=True, slots=True)
class EdgeCandidate:
    """A job the edge may take: what is left of it, and what an edge server needs to know."""

    job_id: str
    remaining_iterations: float
    deadline_s: float
    #: Iterations/s on one cloud GPU (an edge server runs at ``speed`` × this).
    one_gpu_rate: float
    memory_gb: float


def edge_finish_s(job: EdgeCandidate, server: EdgeServer, start_s: float) -> float:
    """When ``job`` ends on ``server`` if it starts there at ``start_s`` (inf: it cannot run)."""
    rate = job.one_gpu_rate * server.speed
    return start_s + job.remaining_iterations / rate if rate > 0 else math.inf


def edge_admission(
    jobs: Sequence[EdgeCandidate], idle: Sequence[EdgeServer], start_s: float
) -> dict[str, str]:
    """Edge servers for jobs the cloud cannot take (EdgeFlow's edge in ElasticFlow's admission
    control, and rule 3): earliest deadline first, each job onto an idle server whose memory
    holds it and on which it meets its deadline starting at ``start_s``, the slowest such
    server (the fast ones stay free for tighter jobs). Returns job id → server id; jobs no
    server can serve are left out."""
    free = list(idle)
    out: dict[str, str] = {}
    for job in sorted(jobs, key=lambda j: (j.deadline_s, j.job_id)):
        fitting = [
            s
            for s in free
            if job.memory_gb <= s.memory_gb and edge_finish_s(job, s, start_s) <= job.deadline_s
        ]
        if fitting:
            server = min(fitting, key=lambda s: (s.speed, s.server_id))
            out[job.job_id] = server.server_id
            free.remove(server)
    return out
