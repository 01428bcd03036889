"""The job policies of the slotted simulator (``libs/sim/slotted.py``), each as the ElasticFlow
paper (Gu et al., ASPLOS 2023, evaluation) and its simulator (pkusys/ElasticFlow, ``scheduler.py``)
define it:

* ``ElasticFlowRounds`` — ElasticFlow (``ef_sim_jobs_access_control``): admission control on
  the slot's arrivals, minimum satisfactory shares, leftover GPUs by marginal gain, their
  overheads. With edge servers it is EdgeFlow (``edgeflow``): ElasticFlow's cloud, round for
  round, and the edge for the arrivals it declines. With ``each`` a slot that does not fit
  whole is decided arrival by arrival (``elasticflow-each``); with edge servers too it is the
  seed's EdgeFlow (``edgeflow-each``): the edge joins that admission, and EdgeFlow's rules 1–3
  (``libs/core/edgeflow.py``).
* ``EdfRounds`` and ``TiresiasRounds``, EDF and Tiresias: ``libs/sim/baseline_rounds.py``.

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
    elasticflow_max_gpu,
    overhead_s,
    plan_all,
    share_leftover,
)
from libs.sim.baseline_rounds import EdfRounds, TiresiasRounds
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
    """ElasticFlow; with ``edge`` servers, EdgeFlow; with ``each``, arrivals decided one by
    one when the slot's do not fit together. ``admit=False`` admits every arrival.

    EdgeFlow without ``each`` (``edgeflow``) leaves ElasticFlow's cloud as it is: the arrivals
    it declines go to idle edge servers where they meet their deadline (``edge_takes``), a job
    on the edge stays there (rule 1), and a job ending on the edge starts no round, so the
    cloud runs round for round as ElasticFlow's does and EdgeFlow meets every deadline
    ElasticFlow meets. Each-arrival admission and rules 2 and 3 change the cloud's later
    decisions, and with them met fewer deadlines than ElasticFlow (195job on 16 GPUs:
    ``bench/results/policies-cloud-sizes.md``), so they run only with ``each``.

    With ``each`` (``edgeflow-each``), EdgeFlow keeps ElasticFlow's cloud and adds, in this
    order each round: rule 1 (a job on
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

    @property
    def edge_ends_wake(self) -> bool:
        """Whether a job ending on the edge starts a round: not for EdgeFlow on ElasticFlow's
        admission, whose cloud then runs round for round as ElasticFlow's does."""
        return self.each

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
        for state in active if self.each else ():  # rule 1's exception; see ``edge_takes``
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
        if waiting and self.idle() and self.each:  # rule 2: no GPU left, they meet it there
            self.on_edge |= edge_admission([as_edge_job(s) for s in waiting], self.idle(), start)
        late = self.rule_3(cloud, jobs, shares, now) if self.each else {}
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
        start = now + overhead_s(1, rescaled=True, restart=False, cluster_gpus=self.cloud_gpus)
        if not self.each:
            return self.edge_takes(arrivals, start)
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

    def edge_takes(self, declined: list[JobState], start: float) -> set[str]:
        """EdgeFlow's admission on ElasticFlow's: the arrivals the cloud declines together go,
        earliest deadline first, to idle edge servers where they meet their deadline
        (``edge_admission``); the rest stay declined. The cloud admits only what ElasticFlow
        admits, so the edge adds jobs and takes none of the cloud's room. Returns the ids
        still declined."""
        taken = edge_admission([as_edge_job(s) for s in declined], self.idle(), start)
        self.on_edge |= taken
        return {s.trace.job_id for s in declined if s.trace.job_id not in taken}

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


#: The policies run in slotted rounds here.
ROUND_POLICIES = ("elasticflow", "edgeflow", "elasticflow-each", "edgeflow-each", "edf", "tiresias")


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
    if name in ("elasticflow", "edgeflow", "elasticflow-each", "edgeflow-each"):
        servers = edge if name.startswith("edgeflow") else ()
        each = name in ("elasticflow-each", "edgeflow-each")
        policy = ElasticFlowRounds(cloud_gpus, servers, each=each, slot_s=slot_s)
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
