"""Deep-learning jobs with deadlines on cloud GPUs and edge servers.

Reads ElasticFlow/ITP traces (``job_id, submission_time, num_iteration, model_name, deadline,
batch_size, num_gpu, duration``) and the ElasticFlow throughput profiles (iterations/s by
global batch size and GPU count). A job progresses at its allocation's measured throughput (an
edge server runs at ``speed`` × one GPU).

Policies, as the ElasticFlow paper and its simulator define them (``libs/sim/round_policies.py``,
run in slot-merged rounds by ``libs/sim/slotted.py``): ``elasticflow`` (admission control,
minimum satisfactory shares, leftover GPUs by marginal gain), ``edgeflow`` (that ElasticFlow
with the edge in admission and its three edge rules: ``libs/core/edgeflow.py``), ``edf``,
``tiresias``, and ``gandiva`` (node sets by GPU class, packing and time-slicing, in its own
loop: ``libs/sim/gandiva.py``). Also ``elasticflow-each``: ElasticFlow whose admission, when a
slot's arrivals do not fit together, decides each on its own (EdgeFlow's admission without the
edge: what of EdgeFlow's gain is not the edge's). And ``elasticflow-noadmit``: the earlier
continuous variant without admission control (rounds at every arrival and completion, no slot,
5 s per placement change: ``libs/core/edgeflow.allocate`` without the edge), kept to show what
admission control is worth.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from libs.core.edgeflow import MIGRATE_EDGE_S, DlJob, EdgeServer, allocate
from libs.sim.workloads import WorkloadError

ITP_COLUMNS = (
    "job_id",
    "submission_time",
    "num_iteration",
    "model_name",
    "deadline",
    "batch_size",
    "num_gpu",
    "duration",
)
#: Memory a training job needs on an edge server (GB): an assumption per model family.
MODEL_MEMORY_GB = {
    "bert": 10.0,
    "gpt2": 14.0,
    "vgg16": 9.0,
    "resnet50": 7.0,
    "inception3": 7.0,
    "deepspeech2": 8.0,
}
MIGRATE_CLOUD_S = 5.0
#: The cloud each shipped trace runs on in the ElasticFlow paper: 195job on its 16 × 8 A100
#: testbed (figure 6), the ITP cluster traces on the 64 × 8 GPUs (``n64g8``) of its figures.
PAPER_CLUSTER_GPUS = {"195job": 128, "cluster01": 512, "cluster03": 512, "cluster05": 512}
#: The edge the bench adds beside the cloud: 16 servers of 16 or 32 GB at 0.2–0.4 × an A100.
BENCH_EDGE_SERVERS = 16
BENCH_EDGE_SPEED = (0.2, 0.4)
JOB_POLICIES = (
    "edgeflow",
    "elasticflow",
    "edf",
    "tiresias",
    "gandiva",
    "elasticflow-each",
    "elasticflow-noadmit",
)


def bench_edge(count: int, rng: np.random.Generator) -> list[EdgeServer]:
    """``count`` edge servers as the bench draws them: 16 or 32 GB, speed U(0.2, 0.4)."""
    return [
        EdgeServer(f"e{i}", float(rng.choice([16.0, 32.0])), float(rng.uniform(*BENCH_EDGE_SPEED)))
        for i in range(count)
    ]


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    submit_s: float
    iterations: float
    model: str
    deadline_s: float
    batch_size: int
    gpus: int
    #: Seconds on ``gpus`` GPUs, as the trace states it (0 when unknown).
    duration_s: float = 0.0
    #: The trace's own clock (s) at time 0, its first ``submission_time``: Gandiva's
    #: time-slicing depends on it (``libs/sim/gandiva.py``).
    clock_s: float = 0.0


def read_itp(
    lines: Iterable[str], *, limit: int | None = None, load: float = 1.0
) -> list[TraceJob]:
    """Jobs of an ITP trace, times relative to the first submission (÷ ``load``)."""
    reader = csv.DictReader(lines)
    missing = set(ITP_COLUMNS) - set(reader.fieldnames or ())
    if missing:
        raise WorkloadError(f"not an ITP job trace: missing columns {sorted(missing)}")
    rows = []
    for n, row in enumerate(reader, start=2):
        try:
            rows.append((float(row["submission_time"]), row, float(row["deadline"])))
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"row {n}: {exc}") from None
    rows.sort(key=lambda r: r[0])
    rows = rows[:limit] if limit else rows
    start = rows[0][0] if rows else 0.0
    return [
        TraceJob(
            row["job_id"],
            (at - start) / load,
            float(row["num_iteration"]),
            row["model_name"],
            (deadline - start) / load,
            int(row["batch_size"]),
            int(row["num_gpu"]),
            float(row["duration"] or 0.0) / load,
            start,
        )
        for at, row, deadline in rows
    ]


Profile = dict[int, dict[int, float]]  # batch size → GPU count → iterations/s


class MissingProfile(ValueError):
    """Jobs of the trace name models that have no throughput profile."""

    def __init__(self, models: list[str], known: list[str]) -> None:
        self.models, self.known = models, known
        have = ", ".join(known) or "none"
        super().__init__(f"no throughput profile for {', '.join(models)} (profiles: {have})")


def read_profile(lines: Iterable[str]) -> Profile:
    """A throughput profile: a header ``global_batch_size, 1, 2, 4, …`` (GPU counts), then one
    row per batch size of iterations/s (blank or 0 where not measured)."""
    reader = csv.reader(lines)
    try:
        counts = [int(c) for c in next(reader)[1:]]
        profile: Profile = {}
        for row in reader:
            if row:
                profile[int(row[0])] = {
                    g: float(v)
                    for g, v in zip(counts, row[1:], strict=False)
                    if v.strip() and float(v) > 0
                }
    except (StopIteration, ValueError) as exc:
        raise WorkloadError(f"not a throughput profile (line {reader.line_num}): {exc}") from None
    return profile


def read_profiles(folder: Path) -> dict[str, Profile]:
    """Every ``<model>.csv`` throughput profile in ``folder``, by model name."""
    profiles = {}
    for path in sorted(folder.glob("*.csv")):
        with path.open() as lines:
            try:
                profiles[path.stem] = read_profile(lines)
            except WorkloadError as exc:
                raise WorkloadError(f"{path}: {exc}") from None
    return profiles


def curve(profile: Profile, batch_size: int) -> dict[int, float]:
    """The throughput curve of the profiled batch size closest to ``batch_size``."""
    nearest = min(profile, key=lambda b: (abs(b - batch_size), b))
    return profile[nearest]


def deadline_bound(
    trace: Sequence[TraceJob],
    profiles: Mapping[str, Profile],
    gpus: int,
    edge_speed: float = 0.0,
) -> float:
    """The most deadlines any policy can meet: each job alone from its arrival on its fastest
    share of ``gpus`` cloud GPUs, or on an edge server of ``edge_speed`` if that is faster."""

    def fastest(t: TraceJob) -> float:
        rates = curve(profiles[t.model], t.batch_size)
        cloud = max((r for g, r in rates.items() if g <= gpus), default=0.0)
        return max(cloud, edge_speed * rates.get(1, 0.0))

    met = sum(t.iterations <= fastest(t) * (t.deadline_s - t.submit_s) for t in trace)
    return met / len(trace) if trace else 1.0


@dataclass
class JobState:
    trace: TraceJob
    curve: dict[int, float]
    done: float = 0.0
    attained_gpu_s: float = 0.0
    placement: tuple[str, int] = ("none", 0)  # ("cloud", gpus) | ("edge:<id>", 1) | ("none", 0)
    paused_until: float = 0.0
    finished_s: float = math.nan
    migrations: int = 0
    declined: bool = False

    def rate(self, edge_speed: Mapping[str, float]) -> float:
        where, count = self.placement
        if where == "cloud":
            return self.curve.get(count, 0.0)
        if where.startswith("edge:"):
            return self.curve.get(1, 0.0) * edge_speed[where[5:]]
        return 0.0


@dataclass
class JobResult:
    jobs: list[JobState]
    migration_s: float
    makespan_s: float
    #: Counts a policy reports about itself (e.g. ElasticFlow's declined slots).
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def deadline_satisfaction_ratio(self) -> float:
        met = sum(1 for j in self.jobs if j.finished_s <= j.trace.deadline_s)
        return met / len(self.jobs) if self.jobs else 1.0


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
        if self.policy != "elasticflow-noadmit":
            from libs.sim.round_policies import run_policy  # it imports this module

            return run_policy(self, trace, profiles)
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
