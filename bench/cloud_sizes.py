"""EdgeFlow against ElasticFlow across cloud sizes: the job traces asked for (by default every
trace in data/) at each size asked for (64, 128, 256 and 512 GPUs in the report), each with 16
edge servers drawn two ways, several draws (seeds) each.

- ``slow``: the bench's edge (``libs/sim/jobs.bench_edge``), 16 or 32 GB at 0.2–0.4 × an A100
  (a Jetson or T4-class box);
- ``gpu``: 16 or 32 GB at 0.5–1.0 × an A100 (a workstation GPU: an RTX 4090, an L4, an A10).
  The T4 throughput profiles in data/ cover other models and batch sizes than the traces' jobs,
  so an edge server is a speed against the job's one-A100 throughput, not a profile of its own.

For each: ElasticFlow's deadline satisfaction, EdgeFlow's (``edgeflow``: ElasticFlow's cloud
untouched, the edge takes what it declines), EdgeFlow − ElasticFlow per draw (the worst is the
goal: ≥ 0), the share of all jobs that met their deadline on the edge, and ``edgeflow-each``
(the seed's rules 1–3 on each-arrival admission) beside it, which gains more on most sizes and
can fall below ElasticFlow.

    python bench/policies.py --jobs-only --cloud-sizes 64,128,256,512 --seeds 2
"""

from __future__ import annotations

import sys

import numpy as np

from libs.sim.data import A100_PROFILES, ITP_TRACES
from libs.sim.job_simulation import JobSimulation
from libs.sim.jobs import BENCH_EDGE_SERVERS, JobResult, bench_edge, read_itp, read_profiles

#: The edge draws: name → (low, high) speed against one A100.
DRAWS = {"slow": (0.2, 0.4), "gpu": (0.5, 1.0)}


def points(result: JobResult) -> float:
    return 100 * result.deadline_satisfaction_ratio


def edge_share(result: JobResult) -> float:
    """Points of all jobs that met their deadline on an edge server."""
    met = sum(
        1
        for j in result.jobs
        if j.placement[0].startswith("edge:") and j.finished_s <= j.trace.deadline_s
    )
    return 100 * met / len(result.jobs) if result.jobs else 0.0


def sweep(traces: list[str], sizes: list[int], seeds: int) -> list[dict[str, object]]:
    """One row per trace, cloud size and edge draw (figures in points, per draw)."""
    profiles = read_profiles(A100_PROFILES)
    rows: list[dict[str, object]] = []
    for name in traces:
        trace = read_itp((ITP_TRACES / f"{name}.csv").open())
        for gpus in sizes:
            base = points(JobSimulation("elasticflow", gpus).run(trace, profiles))
            for kind, speeds in DRAWS.items():
                gain, share, each = [], [], []
                for seed in range(seeds):
                    edge = bench_edge(BENCH_EDGE_SERVERS, np.random.default_rng(seed), speeds)
                    ours = JobSimulation("edgeflow", gpus, edge).run(trace, profiles)
                    gain.append(points(ours) - base)
                    share.append(edge_share(ours))
                    each.append(
                        points(JobSimulation("edgeflow-each", gpus, edge).run(trace, profiles))
                        - base
                    )
                    print(
                        f"\rsizes {name} {gpus} {kind} {seed}", end="", file=sys.stderr, flush=True
                    )
                rows.append(
                    {
                        "trace": name,
                        "cloud_gpus": gpus,
                        "edge": kind,
                        "elasticflow": round(base, 2),
                        "edgeflow_minus_elasticflow_mean": round(float(np.mean(gain)), 2),
                        "edgeflow_minus_elasticflow_worst": round(min(gain), 2),
                        "edge_share_mean": round(float(np.mean(share)), 2),
                        "edgeflow_each_minus_elasticflow_mean": round(float(np.mean(each)), 2),
                        "edgeflow_each_minus_elasticflow_worst": round(min(each), 2),
                    }
                )
    print(file=sys.stderr)
    return rows


def section(rows: list[dict[str, object]], seeds: int) -> tuple[dict[str, float], list[str]]:
    """The goal (EdgeFlow − ElasticFlow, worst row and draw) and the report's section."""
    worst = min(float(r["edgeflow_minus_elasticflow_worst"]) for r in rows)  # type: ignore[arg-type]
    worst_each = min(float(r["edgeflow_each_minus_elasticflow_worst"]) for r in rows)  # type: ignore[arg-type]
    goals = {
        "edgeflow_minus_elasticflow_points_worst_size_trace_draw": worst,
        "edgeflow_each_minus_elasticflow_points_worst_size_trace_draw": worst_each,
    }
    lines = [
        "",
        f"## EdgeFlow − ElasticFlow across cloud sizes ({BENCH_EDGE_SERVERS} edge servers, "
        f"{seeds} draws each; points of deadlines met)",
        "",
        "| trace | cloud GPUs | edge | ElasticFlow | EdgeFlow − ElasticFlow (mean / worst) "
        "| met on the edge | edgeflow-each − ElasticFlow (mean / worst) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['cloud_gpus']} | {r['edge']} | {r['elasticflow']:.2f} "
            f"| {r['edgeflow_minus_elasticflow_mean']:+.2f} / "
            f"{r['edgeflow_minus_elasticflow_worst']:+.2f} | {r['edge_share_mean']:.2f} "
            f"| {r['edgeflow_each_minus_elasticflow_mean']:+.2f} / "
            f"{r['edgeflow_each_minus_elasticflow_worst']:+.2f} |"
        )
    lines += [
        "",
        f"Worst EdgeFlow − ElasticFlow over every trace, size and draw: **{worst:+.2f}** points "
        f"(goal ≥ 0); `edgeflow-each`'s worst: {worst_each:+.2f}. Edge draws: "
        + "; ".join(f"{k} {lo:g}–{hi:g} × an A100" for k, (lo, hi) in DRAWS.items())
        + ".",
    ]
    return goals, lines
