"""Deep-learning jobs with deadlines on cloud GPUs and edge servers: what a job simulation
reads and keeps (``libs/sim/job_simulation.py`` runs the policies on them).

Reads ElasticFlow/ITP traces (``job_id, submission_time, num_iteration, model_name, deadline,
batch_size, num_gpu, duration``) and the ElasticFlow throughput profiles (iterations/s by
global batch size and GPU count). A job progresses at its allocation's measured throughput (an
edge server runs at ``speed`` × one GPU).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from libs.core.edgeflow import EdgeServer
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
#: Every this many rounds all trainers restart (ElasticFlow's simulation loops:
#: ``schedule_count % scheduling_slot == 0``): the slotted policies and Gandiva both charge it.
RESTART_EVERY = 240
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
    "edgeflow-each",
    "elasticflow-noadmit",
)


def restarting(round_no: int) -> bool:
    """Whether round ``round_no`` is one where every trainer restarts."""
    return round_no > 0 and round_no % RESTART_EVERY == 0


def bench_edge(
    count: int, rng: np.random.Generator, speeds: tuple[float, float] = BENCH_EDGE_SPEED
) -> list[EdgeServer]:
    """``count`` edge servers as the bench draws them: 16 or 32 GB, speed uniform in
    ``speeds`` (× an A100; the bench's 0.2–0.4 by default)."""
    return [
        EdgeServer(f"e{i}", float(rng.choice([16.0, 32.0])), float(rng.uniform(*speeds)))
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
