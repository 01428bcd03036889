"""Gandiva as ElasticFlow's simulator runs it (pkusys/ElasticFlow, ``ElasticFlow/scheduler``:
``scheduler.py`` ``gandiva_sim_jobs`` with ``--schedule=gandiva --scheme=gandiva``; ``cluster.py``
``gandiva_placement``, ``gandiva_node_set_adjust`` / ``_expand`` / ``_shrink``,
``time_slicing_execute``). Re-implemented here, not copied; each method names the function of
theirs it follows. The ElasticFlow paper (Gu et al., ASPLOS 2023) uses it as a baseline after
Gandiva (Xiao et al., OSDI 2018): jobs packed and time-sliced on node sets by GPU count.

The rules, as their code has them:

* **Node sets by GPU class.** The cluster is nodes of 8 GPUs. A job runs the trace's GPU count
  for the trace's duration (their ``jobs.py`` gives Gandiva no elastic count), on a *node set* of
  its class (1, 2, 4, 8, 12, 16, 24, …, 256 GPUs): ceil(gpus / 8) whole nodes that run
  ``capacity`` = nodes × 8 // gpus of its jobs at once (8 one-GPU jobs, 4 two-GPU, …, one
  job of 8 GPUs or more). Every model's memory share is 1 (their ``models.m_mem``).
* **Placement** (``gandiva_placement``): into the first set of the class if its count of jobs
  placed stays *below* its capacity (a one-GPU set fills to 7 this way), else on a new set if
  free nodes suffice, else packed onto the first set anyway (time-sliced), else the job waits.
  A set's count is not lowered when a job ends, only when its jobs are re-dealt.
* **Time-slicing** (``time_slicing_execute``): at each round, the first ``capacity`` jobs of
  each set are credited the time since the last round (less their overhead); the rest wait.
  A set's running jobs go to its back only in a round whose time on the trace's own clock
  (``TraceJob.clock_s`` + the round's time) is a whole minute, as in their code: on the shipped
  traces that is rare (0 of 3,212 rounds on 195job, 20 of 2,778 on cluster05), so a packed job
  mostly waits for those ahead of it to end; ignoring the clock moved cluster05 by 2.4 points
  (0.2047 against their 0.2282). A set left empty frees
  its nodes, and waiting jobs are then tried again (in their order, skipping the one after each
  that starts, as their loop over a list it removes from does).
* **Re-balancing** (``gandiva_node_set_adjust``), at the start of each round: each class is
  given floor(its share of GPU demand × cluster GPUs) GPUs, at most its demand; a class below
  that grows by ceil(shortfall / gpus) sets while free nodes last, a class above it gives back
  ceil(excess / gpus) sets (all but one at most; the least loaded first) and deals their jobs
  onto the rest. Growing re-deals the class's jobs over its sets only when it ran out of free
  nodes, or its sets span several nodes (their loop counter is reused by an inner loop);
  otherwise the new sets stay empty and are freed at the next round.
* **Rounds** only at arrivals, merged per slot (an arrival within 240 s of the last round waits
  for the slot's end; the last arrival does not wait), then every slot until all jobs end: a
  job's end does not trigger a round, so its nodes stay held until the next one.
* **Overheads** (``utils.estimate_overhead``): while arrivals remain, every placed job loses
  2 + 2 × (log2 gpus + 1) s each round (7 s base on ≥ 256 GPUs; + 27 s or 47 s every 240th
  round, all trainers restarting), charged when it next runs; after the last arrival, none.

Departures, each for simplicity: a GPU count that is no class runs on the next larger class
(theirs exits); cluster GPUs beyond a multiple of 8 stay unused, and a cloud of fewer than 8
GPUs is one node of that many (as their ``n1g4`` spec); a job with no trace duration
runs at its profiled throughput for its GPU count; a job that can never be placed ends the run
(theirs loops forever).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.core.elasticflow import SLOT_S, overhead_s
from libs.sim.jobs import RESTART_EVERY, JobResult, JobState, Profile, TraceJob, curve

GPUS_PER_NODE = 8
#: The GPU counts that have node sets, in the order their adjustment visits them (``node_g``).
GPU_CLASSES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 88, 128, 256)
#: Their time-slicing switches jobs in rounds whose wall-clock second is a multiple of this.
SWITCH_EVERY_S = 60


def gpu_class(gpus: int) -> int:
    """The node-set class of a job of ``gpus`` GPUs: that count, or the next larger class."""
    return next((c for c in GPU_CLASSES if c >= gpus), GPU_CLASSES[-1])


@dataclass
class NodeSet:
    """Whole nodes serving jobs of one GPU class (their ``node_set`` dict)."""

    gpus: int  # GPUs each of its jobs uses
    nodes: int
    capacity: int  # jobs it runs at once
    #: Jobs placed since its jobs were last dealt (their ``util``); not lowered when one ends.
    placed: int = 0
    jobs: list[JobState] = field(default_factory=list)


@dataclass
class GandivaCluster:
    """The node sets of every class and the free nodes (their ``CLUSTER`` in Gandiva mode)."""

    free_nodes: int
    node_gpus: int = GPUS_PER_NODE
    sets: dict[int, list[NodeSet]] = field(default_factory=lambda: {c: [] for c in GPU_CLASSES})
    gpus: int = field(init=False)  # the whole cluster's (their ``num_gpu``)

    def __post_init__(self) -> None:
        self.gpus = self.free_nodes * self.node_gpus

    def nodes_for(self, klass: int) -> int:
        return math.ceil(klass / self.node_gpus)

    def new_set(self, gpus: int) -> NodeSet:
        nodes = self.nodes_for(gpus)
        self.free_nodes -= nodes
        return NodeSet(gpus, nodes, nodes * self.node_gpus // gpus)

    def place(self, job: JobState) -> bool:
        """Put ``job`` on a node set of its class; False: no set and too few free nodes
        (``gandiva_placement``)."""
        klass = gpu_class(job.trace.gpus)
        sets = self.sets[klass]
        if sets:
            first = sets.pop(0)
            sets.append(first)
            if first.placed + 1 < first.capacity:  # their test is strict
                self._add(sets, first, job)
                return True
        if self.nodes_for(klass) <= self.free_nodes:
            fresh = self.new_set(klass)
            sets.append(fresh)
            self._add(sets, fresh, job)
            return True
        if sets:  # no free nodes: time-slice on the least loaded set
            first = sets.pop(0)
            sets.append(first)
            self._add(sets, first, job)
            return True
        return False

    @staticmethod
    def _add(sets: list[NodeSet], target: NodeSet, job: JobState) -> None:
        target.placed += 1
        target.jobs.append(job)
        sets.sort(key=lambda s: s.placed)  # stable, as theirs

    @staticmethod
    def deal(sets: list[NodeSet], jobs: list[JobState]) -> None:
        """Each job to the first set, re-sorting by load after each (their re-arrangement)."""
        for job in jobs:
            GandivaCluster._add(sets, sets[0], job)

    def adjust(self) -> None:
        """Grow or shrink each class towards its share of the GPU demand
        (``gandiva_node_set_adjust``); the shares use the counts before any change."""
        demand = {c: len([j for s in sets for j in s.jobs]) * c for c, sets in self.sets.items()}
        held = {c: sum(s.nodes for s in sets) * self.node_gpus for c, sets in self.sets.items()}
        total, gpus = sum(demand.values()), self.gpus
        if total == 0:
            return
        for klass, sets in self.sets.items():
            if demand[klass] == 0:
                continue
            target = min(math.floor((demand[klass] / total) * gpus), demand[klass])
            diff = target - held[klass]
            if diff > 0:
                self.expand(klass, sets, math.ceil(diff / klass))
            elif diff < 0:
                self.shrink(sets, math.ceil(-diff / klass))

    def expand(self, klass: int, sets: list[NodeSet], count: int) -> None:
        """Up to ``count`` new sets while free nodes last (``gandiva_node_set_expand``). Their
        loop counter, reused by the inner loop over a set's nodes, decides the re-deal: it ends
        at ``count`` if the last try found no nodes, else at nodes per set − 1."""
        nodes, counter = self.nodes_for(klass), 0
        for tried in range(1, count + 1):
            counter = tried
            if nodes <= self.free_nodes:
                sets.append(self.new_set(klass))
                counter = nodes - 1
        if counter > 0:
            jobs = []
            for s in sets:
                if s.jobs:
                    jobs += s.jobs
                    s.jobs, s.placed = [], 0
            self.deal(sets, jobs)

    def shrink(self, sets: list[NodeSet], count: int) -> None:
        """Free the first ``count`` sets (all but one at most) and deal their jobs onto the
        rest (``gandiva_node_set_shrink``)."""
        count = min(count, len(sets) - 1)
        jobs = []
        for _ in range(count):
            freed = sets.pop(0)
            jobs += freed.jobs
            self.free_nodes += freed.nodes
        if count > 0:
            self.deal(sets, jobs)

    def execute(
        self, now: float, step_s: float, progress: JobProgress, rotate: bool
    ) -> tuple[list[JobState], bool]:
        """Credit the first ``capacity`` jobs of each set with the ``step_s`` seconds up to
        ``now``; rotate them to the back if ``rotate``; drop ended jobs and empty sets
        (``time_slicing_execute``). Returns the jobs that ended and whether a set was freed."""
        ended: list[JobState] = []
        freed = False
        for sets in self.sets.values():
            for node_set in list(sets):
                runs = node_set.jobs[: node_set.capacity]
                done = [job for job in runs if progress.run(job, now, step_s)]
                if rotate and len(node_set.jobs) > len(runs):
                    node_set.jobs = node_set.jobs[len(runs) :] + runs
                gone = {id(job) for job in done}
                node_set.jobs = [job for job in node_set.jobs if id(job) not in gone]
                ended += done
                if not node_set.jobs:
                    self.free_nodes += node_set.nodes
                    sets.remove(node_set)
                    freed = True
        return ended, freed


@dataclass
class JobProgress:
    """Each job's seconds run towards its duration, and the overhead it pays when next run."""

    duration_s: dict[str, float]
    executed_s: dict[str, float] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)

    def run(self, job: JobState, now: float, step_s: float) -> bool:
        """Credit ``job`` the ``step_s`` seconds up to ``now`` less its overhead; True if it
        ended (then at ``now`` less the surplus)."""
        job_id, duration = job.trace.job_id, self.duration_s[job.trace.job_id]
        run_s = max(step_s - self.overhead_s.pop(job_id, 0.0), 0.0)
        before = self.executed_s.get(job_id, 0.0)
        self.executed_s[job_id] = before + run_s
        job.attained_gpu_s += min(run_s, max(duration - before, 0.0)) * job.trace.gpus
        job.done = job.trace.iterations * min(1.0, self.executed_s[job_id] / duration)
        if self.executed_s[job_id] < duration:
            return False
        job.finished_s = now - (self.executed_s[job_id] - duration)
        return True


def duration_s(job: TraceJob, profiles: Mapping[str, Profile]) -> float:
    """Seconds the job runs on its GPU count: the trace's, else from its profiled throughput."""
    if job.duration_s > 0:
        return job.duration_s
    rates = curve(profiles[job.model], job.batch_size)
    rate = rates.get(job.gpus) or max((r for g, r in rates.items() if g <= job.gpus), default=0)
    return job.iterations / rate if rate > 0 else math.inf


def run_gandiva(
    trace: Sequence[TraceJob],
    profiles: Mapping[str, Profile],
    cloud_gpus: int,
    slot_s: float = SLOT_S,
) -> JobResult:
    """Run ``trace`` under Gandiva on ``cloud_gpus`` GPUs (``gandiva_sim_jobs``). Raises
    ``ValueError`` for a cloud without a GPU."""
    if cloud_gpus < 1:
        raise ValueError(f"Gandiva needs at least one GPU; got {cloud_gpus}")
    progress = JobProgress({t.job_id: duration_s(t, profiles) for t in trace})
    states = [JobState(t, {t.gpus: t.iterations / progress.duration_s[t.job_id]}) for t in trace]
    node_gpus = min(GPUS_PER_NODE, cloud_gpus)  # a small cloud is one node (their ``n1g4``)
    cluster = GandivaCluster(cloud_gpus // node_gpus, node_gpus)
    # Arrival events by time; merged per slot as the run goes (their ``job_events``).
    events: list[tuple[float, list[JobState]]] = []
    for state in sorted(states, key=lambda s: s.trace.submit_s):
        if events and events[-1][0] == state.trace.submit_s:
            events[-1][1].append(state)
        else:
            events.append((state.trace.submit_s, [state]))
    pending: list[JobState] = []
    running: list[JobState] = []
    was_pending: set[str] = set()  # their ``runnable_jobs``
    now, step, rounds = (events[0][0] if events else 0.0), 0.0, 0
    clock_s = trace[0].clock_s if trace else 0.0
    while events or pending or running:
        cluster.adjust()
        rotate = int((clock_s + now) % SWITCH_EVERY_S) == 0
        ended, freed = cluster.execute(now, step, progress, rotate)
        gone = {id(job) for job in ended}
        running = [s for s in running if id(s) not in gone]
        for job_id in was_pending:
            progress.overhead_s.pop(job_id, None)
        if events and events[0][0] == now:
            for state in events.pop(0)[1]:
                if cluster.place(state):
                    running.append(state)
                else:
                    pending.append(state)
                    was_pending.add(state.trace.job_id)
        if freed:
            index = 0
            while index < len(pending):
                if cluster.place(pending[index]):
                    running.append(pending.pop(index))
                index += 1  # their loop skips the job after one that starts
        if not events:
            if not running:
                break  # the rest can never be placed
            step, now = slot_s, now + slot_s
            continue
        restart = rounds > 0 and rounds % RESTART_EVERY == 0
        rounds += 1
        for state in running:
            progress.overhead_s[state.trace.job_id] = overhead_s(
                state.trace.gpus, rescaled=True, restart=restart, cluster_gpus=cluster.gpus
            )
        # Arrivals within a slot of now wait for its end, merged (unless only one is left).
        while len(events) > 1 and events[0][0] - now <= slot_s:
            merged = (now + slot_s, events[0][1])
            if events[1][0] - now > slot_s:
                events[0] = merged
                break
            events[0:2] = [(merged[0], merged[1] + events[1][1])]
        step, now = events[0][0] - now, events[0][0]
    return JobResult(states, 0.0, now)
