"""The job policies of the slotted simulator (``libs/sim/slotted.py``), each as the ElasticFlow
paper (Gu et al., ASPLOS 2023, evaluation) and its simulator (pkusys/ElasticFlow, ``scheduler.py``)
define it:

* ``ElasticFlowRounds`` — ElasticFlow (``ef_sim_jobs_access_control``): admission control on
  the slot's arrivals, minimum satisfactory shares, leftover GPUs by marginal gain, their
  overheads. With ``each`` a slot that does not fit whole is decided arrival by arrival
  (``elasticflow-each``); with edge servers too it is EdgeFlow: the edge joins admission, and
  EdgeFlow's rules 1–3 (``libs/core/edgeflow.py``).
* ``EdfRounds`` — EDF (``one_queue_edf_sim_jobs``): earliest deadline first, each job up to
  min(64, batch size, largest profiled count) GPUs, re-planned every round, no admission, no
  overhead charged (their EDF sets it to 0).
* ``TiresiasRounds`` — Tiresias (``dlas_sim_jobs(gputime=True)``): discretised 2D-LAS, three
  queues split at 3,250 and 7,200 GPU-seconds attained, FIFO within a queue, first fit, the
  trace's GPU count and duration, a start overhead when a job (re)starts.

Gandiva (``gandiva_sim_jobs``) has its own loop, in ``libs/sim/gandiva.py``; the continuous
``elasticflow-noadmit`` runs in ``libs/sim/job_simulation.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.core.edgeflow import (
    MIGRATE_EDGE_S,
    EdgeCandidate,
    EdgeServer,
    edge_admission,
    edge_finish_s,
)
from libs.core.elasticflow import (
    SLOT_S,
    PlanJob,
    admissible,
    baseline_max_gpu,
    elasticflow_max_gpu,
    overhead_s,
    plan_all,
    share_leftover,
)
from libs.sim.jobs import (
    MODEL_MEMORY_GB,
    JobResult,
    JobState,
    Profile,
    TraceJob,
    restarting,
)
from libs.sim.slotted import Decision, RoundPolicy, run_rounds


def plan_job(state: JobState, delay_s: float = 0.0, tail: EdgeServer | None = None) -> PlanJob:
    """The job as ElasticFlow plans it: its curve up to its max GPUs; ``delay_s`` lost first;
    with ``tail`` (EdgeFlow), an edge server that may run its last part."""
    cap = elasticflow_max_gpu(state.trace.model, state.trace.batch_size)
    return PlanJob(
        state.trace.job_id,
        state.trace.iterations - state.done,
        state.trace.deadline_s - delay_s,
        {g: r for g, r in state.curve.items() if g <= cap},
        state.curve.get(1, 0.0) * tail.speed if tail else 0.0,
        MIGRATE_EDGE_S if tail else 0.0,
    )


def plan_end(job: PlanJob, gpus: int, now: float) -> float:
    """When ``job`` ends holding ``gpus`` from ``now`` (inf: it cannot run on that many)."""
    rate = job.throughput.get(gpus, 0.0) if gpus > 0 else 0.0
    return now + job.remaining_iterations / rate if rate > 0 else math.inf


def as_edge_job(state: JobState) -> EdgeCandidate:
    """The job as the edge rules see it (one GPU's throughput, memory by model family)."""
    return EdgeCandidate(
        state.trace.job_id,
        state.trace.iterations - state.done,
        state.trace.deadline_s,
        state.curve.get(1, 0.0),
        MODEL_MEMORY_GB.get(state.trace.model, 8.0),
    )


@dataclass
class ElasticFlowRounds:
    """ElasticFlow; with ``each``, arrivals decided one by one when the slot's do not fit
    together; with ``edge`` servers too, EdgeFlow. ``admit=False`` admits every arrival.

    EdgeFlow keeps ElasticFlow's cloud and adds, in this order each round: rule 1 (a job on
    the edge stays unless it misses there and the cloud can still take it back), a job whose
    reserved edge server can now finish it by its deadline moves there (the end of the kept
    servers of ``keep_tails``), admission with the edge (``admission``), ElasticFlow's plan and
    leftover GPUs, rule 2 (a job left without a GPU runs on an idle edge server where it meets
    its deadline), then rule 3 (``rule_3``) and, if it moved any job, the plan again."""

    cloud_gpus: int
    edge: Sequence[EdgeServer] = ()
    admit: bool = True
    #: Decide each arrival on its own when the slot's arrivals do not fit together.
    each: bool = False
    slot_s: float = SLOT_S
    held: dict[str, int] = field(default_factory=dict)  # GPUs each job held last round
    on_edge: dict[str, str] = field(default_factory=dict)  # job → the edge server it runs on
    tails: dict[str, str] = field(default_factory=dict)  # job → edge server kept for its end
    #: Slots whose arrivals were declined, and how many of those held an arrival that no share
    #: of the whole, empty cloud finishes by its deadline (capacity cannot save such a slot).
    counts: dict[str, int] = field(
        default_factory=lambda: {"declined_slots": 0, "declined_slots_with_a_hopeless_job": 0}
    )

    def idle(self) -> list[EdgeServer]:
        busy = set(self.on_edge.values()) | set(self.tails.values())
        return [e for e in self.edge if e.server_id not in busy]

    def planned(self, state: JobState, delay_s: float = 0.0) -> PlanJob:
        servers = {e.server_id: e for e in self.edge}
        return plan_job(state, delay_s, servers.get(self.tails.get(state.trace.job_id, "")))

    def fits(self, states: list[JobState], now: float) -> bool:
        jobs = [self.planned(s) for s in states]
        return admissible(jobs, self.cloud_gpus, now, self.slot_s)

    def round(
        self, active: list[JobState], arrivals: list[JobState], now: float, round_no: int
    ) -> Decision:
        live = {s.trace.job_id for s in active}
        self.on_edge = {j: e for j, e in self.on_edge.items() if j in live}
        self.tails = {j: e for j, e in self.tails.items() if j in live}
        servers = {e.server_id: e for e in self.edge}
        cloud = [s for s in active if s.trace.job_id not in self.on_edge]
        for state in active:
            job_id = state.trace.job_id
            server = servers.get(self.on_edge.get(job_id, ""))
            if server is None:
                continue
            if edge_finish_s(as_edge_job(state), server, now) <= state.trace.deadline_s:
                continue
            back = [plan_job(s) for s in cloud] + [plan_job(state, MIGRATE_EDGE_S)]
            if admissible(back, self.cloud_gpus, now, self.slot_s):  # rule 1's exception
                cloud.append(state)
                del self.on_edge[job_id]
        for state in list(cloud):
            job_id = state.trace.job_id
            server = servers.get(self.tails.get(job_id, ""))
            start = now + MIGRATE_EDGE_S
            if (
                server
                and edge_finish_s(as_edge_job(state), server, start) <= state.trace.deadline_s
            ):
                self.on_edge[job_id] = self.tails.pop(job_id)
                cloud.remove(state)
        declined = self.admission(cloud, arrivals, now)
        admitted = [s for s in arrivals if s.trace.job_id not in declined]
        if declined:
            self.counts["declined_slots"] += 1
            if any(not self.fits([s], now) for s in arrivals if s.trace.job_id in declined):
                self.counts["declined_slots_with_a_hopeless_job"] += 1
        cloud = [s for s in cloud + admitted if s.trace.job_id not in self.on_edge]
        jobs = [self.planned(s) for s in cloud]
        plans, timeline = plan_all(jobs, self.cloud_gpus, now, self.slot_s)
        free_now = int(timeline.free[0]) if len(timeline.free) else self.cloud_gpus
        now_gpus = {job_id: plan.gpus_now for job_id, plan in plans.items()}
        shares = share_leftover(jobs, now_gpus, free_now)
        start = now + MIGRATE_EDGE_S
        waiting = [s for s in cloud if shares.get(s.trace.job_id, 0) == 0]
        if waiting and self.idle():  # rule 2: no GPU left for them, they meet it on the edge
            self.on_edge |= edge_admission([as_edge_job(s) for s in waiting], self.idle(), start)
        late = self.rule_3(cloud, jobs, shares, now)
        if late:
            self.on_edge |= late
            jobs = [j for j in jobs if j.job_id not in self.on_edge]
            plans, timeline = plan_all(jobs, self.cloud_gpus, now, self.slot_s)
            free_now = int(timeline.free[0]) if len(timeline.free) else self.cloud_gpus
            now_gpus = {job_id: plan.gpus_now for job_id, plan in plans.items()}
            shares = share_leftover(jobs, now_gpus, free_now)
        placements: dict[str, tuple[str, int]] = {
            job_id: ("cloud", g)
            for job_id, g in shares.items()
            if g > 0 and job_id not in self.on_edge
        }
        placements |= {job_id: (f"edge:{e}", 1) for job_id, e in self.on_edge.items()}
        restart = restarting(round_no)
        # An edge job runs on its own server undisturbed: it pays only its start (a move
        # from the cloud pays the checkpoint instead, charged by the simulator).
        overhead = {
            job_id: overhead_s(
                g,
                rescaled=self.held.get(job_id, 0) != g,
                restart=restart,
                cluster_gpus=self.cloud_gpus,
            )
            for job_id, (where, g) in placements.items()
            if where == "cloud" or job_id not in self.held
        }
        self.held = {
            job_id: (g if where == "cloud" else -1) for job_id, (where, g) in placements.items()
        }
        return Decision(placements, declined, overhead)

    def rule_3(
        self, cloud: list[JobState], jobs: list[PlanJob], shares: dict[str, int], now: float
    ) -> dict[str, str]:
        """EdgeFlow's rule 3: with edge servers still idle, the cloud jobs least able to meet
        their deadline go to the edge, lowest cloud-resource priority first (priority = deadline
        − end with one more step of GPUs from now; only jobs below 0, which miss even so), each
        onto the fastest idle server its memory fits. Their GPUs go to the jobs that stay."""
        idle = sorted(self.idle(), key=lambda e: (-e.speed, e.server_id))
        if not idle:
            return {}
        by_id = {s.trace.job_id: s for s in cloud}
        ranked = []
        for job in jobs:
            held = shares.get(job.job_id, 0)
            more = min((c for c in job.throughput if c > held), default=held)
            end = plan_end(job, more, now)
            if job.deadline_s - end < 0 and job.job_id not in self.on_edge:
                ranked.append((job.deadline_s - end, job.job_id))
        out: dict[str, str] = {}
        for _, job_id in sorted(ranked):
            memory = MODEL_MEMORY_GB.get(by_id[job_id].trace.model, 8.0)
            server = next((e for e in idle if memory <= e.memory_gb), None)
            if server is None:
                continue
            idle.remove(server)
            out[job_id] = server.server_id
        return out

    def admission(self, cloud: list[JobState], arrivals: list[JobState], now: float) -> set[str]:
        """Admission control. ElasticFlow (their ``ef_sim_jobs_access_control``) admits the
        slot's arrivals together when every job can still meet its deadline, and else declines
        them together. With ``each`` (EdgeFlow, and ``elasticflow-each`` without the edge) a
        failed check is followed by each arrival on its own, earliest deadline first: into the
        cloud when every deadline still holds with it; else (EdgeFlow) onto an idle edge server
        where it meets its deadline; else into the cloud with an idle edge server kept for the
        end of it or of a cloud job (EdgeFlow's rule 2, made safe: the job moves there only once the
        server can finish it by its deadline); else declined. Returns the ids declined."""
        if not arrivals or not self.admit or self.fits(cloud + arrivals, now):
            return set()
        if not self.each:
            return {s.trace.job_id for s in arrivals}
        start = now + overhead_s(1, rescaled=True, restart=False, cluster_gpus=self.cloud_gpus)
        admitted: list[JobState] = []
        declined: set[str] = set()
        for state in sorted(arrivals, key=lambda s: (s.trace.deadline_s, s.trace.job_id)):
            if self.fits([*cloud, *admitted, state], now):
                admitted.append(state)
                continue
            taken = edge_admission([as_edge_job(state)], self.idle(), start) if self.edge else {}
            if taken:
                self.on_edge |= taken
            elif self.keep_tails(cloud + admitted, state, now):
                admitted.append(state)
            else:
                declined.add(state.trace.job_id)
        return declined

    def keep_tails(self, cloud: list[JobState], arrival: JobState, now: float) -> bool:
        """Keep idle edge servers, one at a time (the fastest first), for the end of the job
        each relieves the cloud of most, until ``arrival`` fits beside ``cloud``. True when it
        fits; else the servers kept here are freed again."""
        kept: list[str] = []
        after = now + MIGRATE_EDGE_S
        for server in sorted(self.idle(), key=lambda e: (-e.speed, e.server_id)):
            candidates = [
                s
                for s in [*cloud, arrival]
                if s.trace.job_id not in self.tails
                and MODEL_MEMORY_GB.get(s.trace.model, 8.0) <= server.memory_gb
                and s.trace.deadline_s > after
            ]
            if not candidates:
                break

            def relief(s: JobState, server: EdgeServer = server) -> float:
                """Iterations the server could take off the cloud for this job."""
                edge_work = s.curve.get(1, 0.0) * server.speed * (s.trace.deadline_s - after)
                return min(s.trace.iterations - s.done, edge_work)

            best = max(candidates, key=lambda s: (relief(s), s.trace.job_id))
            self.tails[best.trace.job_id] = server.server_id
            kept.append(best.trace.job_id)
            if self.fits([*cloud, arrival], now):
                return True
        for job_id in kept:  # it did not help: the servers stay free
            del self.tails[job_id]
        return False


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


#: The policies run in slotted rounds here.
ROUND_POLICIES = ("elasticflow", "edgeflow", "elasticflow-each", "edf", "tiresias")


def run_policy(
    name: str,
    cloud_gpus: int,
    edge: Sequence[EdgeServer],
    slot_s: float,
    trace: Sequence[TraceJob],
    profiles: Mapping[str, Profile],
) -> JobResult:
    """Run the slotted policy ``name`` (one of ``ROUND_POLICIES``) on ``cloud_gpus`` GPUs and
    ``edge`` servers (only EdgeFlow places jobs there), a round every ``slot_s`` at most."""
    policy: RoundPolicy
    rates = None
    if name in ("elasticflow", "edgeflow", "elasticflow-each"):
        servers = edge if name == "edgeflow" else ()
        policy = ElasticFlowRounds(cloud_gpus, servers, each=name != "elasticflow", slot_s=slot_s)
    elif name == "edf":
        policy = EdfRounds(cloud_gpus)
    elif name == "tiresias":
        policy = TiresiasRounds(cloud_gpus)
        # Their Tiresias runs a job for its trace duration at the trace's GPU count.
        rates = {t.job_id: {t.gpus: t.iterations / t.duration_s} for t in trace if t.duration_s > 0}
    else:
        raise ValueError(f"{name!r} is not run in rounds; these are: {', '.join(ROUND_POLICIES)}")
    edge_speed = {e.server_id: e.speed for e in edge}
    return run_rounds(policy, trace, profiles, edge_speed, slot_s, rates)
