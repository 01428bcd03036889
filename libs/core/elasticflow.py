"""ElasticFlow (Gu et al., ASPLOS 2023) as its authors built it: admission control over a
slotted plan of the cluster's free GPUs, minimum satisfactory shares, leftover GPUs by marginal
gain, and the GPU-count and overhead rules of their simulator (pkusys/ElasticFlow,
``ElasticFlow/scheduler``). Re-implemented here, not copied; each function names the function
of theirs it follows.

Time is cut into slots of ``slot_s`` (240 s on their testbed) counted from ``now``. A plan
gives each job, in deadline order, the fewest GPUs (its *minimum satisfactory share*, in the
paper's words) that finish it by its deadline given what earlier-deadline jobs already hold,
slot by slot; a job that no share can finish makes the plan infeasible (the paper's admission
control).

Departures from their code, each for simplicity: a job's share is laid out from now on (they lay
it out backwards from the deadline, the level below it before); a step's GPU-seconds are those
of running the rest at the new count (they compare two whole plans); a job counts as re-launched
when its GPU count changes (they track the exact GPU ranks it held).

Pure: ``now`` is passed in; throughput comes from measured curves (iterations/s by GPU count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: Their testbed's and simulator's scheduling slot (``--scheduling_slot=240``).
SLOT_S = 240.0
#: Their cap on a job's GPUs for EDF, Tiresias and Gandiva (``jobs.py``, ``add_job``).
BASELINE_GPU_CAP = 64


def elasticflow_max_gpu(model: str, batch_size: int) -> int:
    """The most GPUs ElasticFlow gives a job on A100s, by model and global batch size: their
    ``models.get_max_gpu`` (A100 branch), where scaling stops paying on the testbed."""
    if model == "deepspeech2":
        return batch_size
    if model == "gpt2" and batch_size in (128, 256):
        return 16 if batch_size == 128 else 32
    if model == "bert":
        return 8 if batch_size == 64 else 16
    if model == "inception3" and batch_size in (64, 128):
        return 16 if batch_size == 64 else 32
    if model == "resnet50":
        return 32 if batch_size == 64 else min(batch_size, 64)
    if model == "vgg16" and batch_size == 64:
        return 32
    return min(batch_size, 64)


def baseline_max_gpu(throughput: Mapping[int, float], batch_size: int) -> int:
    """The most GPUs EDF gives a job: min(64, batch size, largest profiled count) — their
    ``jobs.py`` ``add_job`` for every scheduler but ElasticFlow (the trace's ``num_gpu`` is not
    used)."""
    return min(BASELINE_GPU_CAP, batch_size, max(throughput, default=0))


def overhead_s(gpus: int, *, rescaled: bool, restart: bool, cluster_gpus: int) -> float:
    """Seconds a job with ``gpus`` GPUs loses in a scheduling round: their
    ``utils.estimate_overhead``. 2 s per round (7 s on clusters of 256 GPUs or more), plus
    2 × (log2 gpus + 1) s when its workers are re-launched (``rescaled``: its GPU count
    changed; their simulator asks whether its exact GPU ranks were used before), plus 27 s (47 s
    on 256+ GPUs) when every trainer restarts (every 240th round)."""
    big = cluster_gpus >= 256
    cost = 7.0 if big else 2.0
    if restart:
        cost += 47.0 if big else 27.0
    if rescaled or restart:
        cost += (math.log2(max(gpus, 1)) + 1) * 2
    return cost


@dataclass(frozen=True, slots=True)
class PlanJob:
    job_id: str
    remaining_iterations: float
    deadline_s: float
    #: Iterations/s by GPU count, only the counts the job may use (≤ its max GPUs).
    throughput: Mapping[int, float]
    #: EdgeFlow: iterations/s on an edge server reserved for the job's last part (0: none),
    #: and the seconds a move there costs.
    tail_rate: float = 0.0
    tail_delay_s: float = 0.0


@dataclass
class Timeline:
    """Free GPUs in each slot from ``now``: slot k is [now + k·slot_s, now + (k+1)·slot_s).
    Beyond the array every GPU is free."""

    gpus: int
    now: float
    slot_s: float = SLOT_S
    free: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def span(self, slots: int) -> np.ndarray:
        if len(self.free) < slots:
            grown = np.full(slots, self.gpus, dtype=np.int64)
            grown[: len(self.free)] = self.free
            self.free = grown
        return self.free[:slots]


@dataclass(frozen=True, slots=True)
class JobPlan:
    meets_deadline: bool
    #: GPUs held in each slot from now (the last one is the slot it ends in).
    gpus_by_slot: np.ndarray
    end_s: float

    @property
    def gpus_now(self) -> int:
        return int(self.gpus_by_slot[0]) if len(self.gpus_by_slot) else 0


def _levels(job: PlanJob, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """``level[f]``: the largest profiled count ≤ f GPUs (0: none fits); ``rate[g]``: it/s."""
    counts = sorted(c for c in job.throughput if c <= gpus)
    level = np.zeros(gpus + 1, dtype=np.int64)
    for c in counts:
        level[c:] = c
    rate = np.zeros(gpus + 1)
    for c in counts:
        rate[c] = job.throughput[c]
    return level, rate


def plan_job(job: PlanJob, timeline: Timeline) -> JobPlan:
    """The job's minimum satisfactory share on what ``timeline`` leaves free, reserved in it:
    their ``ef_sim_allocation``. Shares are tried from the fewest GPUs up; in each slot the job
    holds the largest profiled count ≤ min(share, free GPUs) (their ``get_last_level``) and its
    last slot is rounded up to a slot boundary (``align_to_time_slot``). When no share meets
    the deadline the job is planned on its largest share until it ends (``meets_deadline``
    False). A job with a ``tail_rate`` (EdgeFlow) may end on its edge server instead: the cloud
    then holds it only until the slot after which the edge can do the rest by the deadline."""
    gpus, now, slot = timeline.gpus, timeline.now, timeline.slot_s
    level, rate = _levels(job, gpus)
    counts = [c for c in sorted(job.throughput) if c <= gpus]
    if not counts or job.remaining_iterations <= 0:
        return JobPlan(job.remaining_iterations <= 0, np.zeros(0, dtype=np.int64), now)
    to_deadline = job.deadline_s - now
    slots = math.ceil(to_deadline / slot) if to_deadline > 0 else 0
    if slots > 0:
        if job.tail_rate * (to_deadline - job.tail_delay_s) >= job.remaining_iterations:
            return JobPlan(True, np.zeros(0, dtype=np.int64), job.deadline_s)  # all on the edge
        free = timeline.span(slots)
        # Seconds of each slot before the deadline (the last slot may be cut short).
        seconds = np.minimum(slot, to_deadline - slot * np.arange(slots))
        # What the edge can still do after each slot, if the job moves there then.
        after = to_deadline - slot * (np.arange(slots) + 1) - job.tail_delay_s
        tail = job.tail_rate * np.maximum(after, 0.0)
        for quota in counts:
            held = level[np.minimum(free, quota)]
            done = np.cumsum(rate[held] * seconds)
            if done[-1] >= job.remaining_iterations:
                return _reserve(job, timeline, held, done, True)
            if job.tail_rate > 0 and np.any(done + tail >= job.remaining_iterations):
                last = int(np.argmax(done + tail >= job.remaining_iterations))
                timeline.free[: last + 1] -= held[: last + 1]
                return JobPlan(True, held[: last + 1].copy(), job.deadline_s)
    # No share meets the deadline: the largest, as long as it takes.
    quota = counts[-1]
    horizon = len(timeline.free) + math.ceil(job.remaining_iterations / (rate[quota] * slot)) + 1
    free = timeline.span(horizon)
    held = level[np.minimum(free, quota)]
    seconds = np.full(horizon, slot)
    done = np.cumsum(rate[held] * seconds)
    return _reserve(job, timeline, held, done, False)


def _reserve(
    job: PlanJob,
    timeline: Timeline,
    held: np.ndarray,
    done: np.ndarray,
    meets: bool,
) -> JobPlan:
    last = int(np.searchsorted(done, job.remaining_iterations - 1e-9))
    before = float(done[last - 1]) if last > 0 else 0.0
    in_last = (job.remaining_iterations - before) / rate_of(job, int(held[last]))
    end = timeline.now + last * timeline.slot_s + in_last
    gpus_by_slot = held[: last + 1].copy()
    timeline.free[: last + 1] -= gpus_by_slot
    return JobPlan(meets and end <= job.deadline_s + 1e-6, gpus_by_slot, end)


def rate_of(job: PlanJob, gpus: int) -> float:
    return float(job.throughput.get(gpus, 0.0)) if gpus > 0 else 0.0


def plan_all(
    jobs: Sequence[PlanJob], gpus: int, now: float, slot_s: float = SLOT_S
) -> tuple[dict[str, JobPlan], Timeline]:
    """Every job planned in deadline order on one timeline: their ``estimate_all_jobs``."""
    timeline = Timeline(gpus, now, slot_s)
    plans = {}
    for job in sorted(jobs, key=lambda j: (j.deadline_s, j.job_id)):
        plans[job.job_id] = plan_job(job, timeline)
    return plans, timeline


def admissible(jobs: Sequence[PlanJob], gpus: int, now: float, slot_s: float = SLOT_S) -> bool:
    """Admission control (the paper's; their ``ef_sim_jobs_access_control``): true when every
    job can still meet its deadline together."""
    plans, _ = plan_all(jobs, gpus, now, slot_s)
    return all(p.meets_deadline for p in plans.values())


def share_leftover(jobs: Sequence[PlanJob], now_gpus: dict[str, int], free: int) -> dict[str, int]:
    """Free GPUs of the current slot, one step up a job's curve at a time, by marginal value as
    their code ranks it (the paper's elastic resource allocation; their ``allocate_free_gpus``
    and ``get_marginal``): a job holding no GPU first, then the job whose next step adds the most
    GPU-seconds per extra GPU (their ``marginal_gputime``, sorted largest first). Returns the
    new counts."""
    out = dict(now_gpus)
    by_id = {j.job_id: j for j in jobs}

    def step(job: PlanJob) -> tuple[float, float, str, int] | None:
        """(rank, −deadline, id, next count) of one more step for ``job``; None: none left."""
        held = out.get(job.job_id, 0)
        more = min((c for c in job.throughput if c > held), default=None)
        if more is None:
            return None
        if held == 0:
            return (math.inf, -job.deadline_s, job.job_id, more)
        left = job.remaining_iterations
        added = more * left / rate_of(job, more) - held * left / rate_of(job, held)
        return (added / (more - held), -job.deadline_s, job.job_id, more)

    steps = {job_id: step(job) for job_id, job in by_id.items()}
    while free > 0:
        fitting = [s for s in steps.values() if s is not None and s[3] - out.get(s[2], 0) <= free]
        if not fitting:
            break
        _, _, job_id, more = max(fitting, key=lambda s: (s[0], s[1]))
        free -= more - out.get(job_id, 0)
        out[job_id] = more
        steps[job_id] = step(by_id[job_id])
    return out
