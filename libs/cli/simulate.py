"""``tessera simulate``: run policies on a workload and a fleet, print metrics or compare."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from libs.cli.tables import Column, show
from libs.contracts import Mode
from libs.core.policies import make_policy
from libs.core.profiles import BUILTIN_PROFILES
from libs.devices.fleetfile import FleetSpec, build, fleet_from_file
from libs.sim.fleets import builtin
from libs.sim.metrics import summarise
from libs.sim.serving import ServingSimulation, SimResult
from libs.sim.workloads import Request, WorkloadError, read_azure

DEFAULT_MODEL = "llama-3.2-1b-instruct"
COLUMNS = (
    "completed",
    "failed",
    "throughput_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "tokens_per_joule",
    "energy_j",
    "jain_index",
    "decision_p99_us",
)


def fleet_spec(name_or_path: str) -> FleetSpec:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json", ".toml") or path.exists():
        if not path.exists():
            raise SystemExit(f"fleet file {path} not found")
        try:
            return fleet_from_file(path)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    try:
        return builtin(name_or_path)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None


def requests(workload: Path, kind: str, limit: int | None, load: float) -> list[Request]:
    if not workload.exists():
        raise SystemExit(f"workload {workload} not found")
    with workload.open() as lines:
        try:
            return read_azure(lines, limit=limit, load=load)
        except WorkloadError as exc:
            raise SystemExit(f"{workload}: {exc}") from None


def simulate(
    policy: str, spec: FleetSpec, reqs: list[Request], mode: Mode, seed: int, model: str
) -> SimResult:
    chosen = make_policy(policy, BUILTIN_PROFILES[mode])
    return ServingSimulation(build(spec), chosen, model=model, seed=seed).run(reqs)


def run_jobs(
    workload: Path,
    fleet: str,
    policy: str,
    load: float,
    limit: int | None,
    profiles_dir: Path,
    gpus: int | None = None,
    edge_servers: int | None = None,
    seed: int = 0,
) -> dict[str, float | int]:
    """The deep-learning job simulator (throughput profiles from ``profiles_dir``: one
    ``<model>.csv`` per model a job names). The cloud has ``gpus`` GPUs and the edge
    ``edge_servers`` servers drawn as the bench draws them (with ``seed``); unset, a shipped
    trace gets the paper's cluster and the bench's 16 servers, any other trace ``fleet``'s."""
    import math

    import numpy as np

    from libs.core.edgeflow import EdgeServer
    from libs.sim.job_simulation import JobSimulation
    from libs.sim.jobs import (
        BENCH_EDGE_SERVERS,
        PAPER_CLUSTER_GPUS,
        MissingProfile,
        bench_edge,
        read_itp,
        read_profiles,
    )

    if not workload.exists():
        raise SystemExit(f"workload {workload} not found")
    if not profiles_dir.is_dir():
        raise SystemExit(f"profiles folder {profiles_dir} not found")
    try:
        profiles = read_profiles(profiles_dir)
    except WorkloadError as exc:
        raise SystemExit(str(exc)) from None
    shipped = workload.stem in PAPER_CLUSTER_GPUS
    need_fleet = not shipped and (gpus is None or edge_servers is None)
    devices = build(fleet_spec(fleet)) if need_fleet else []
    if gpus is None:
        cloud = sum(d.capabilities.gpu_count for d in devices if d.device_class == "cloud_gpu")
        gpus = PAPER_CLUSTER_GPUS[workload.stem] if shipped else cloud
    if edge_servers is None and shipped:
        edge_servers = BENCH_EDGE_SERVERS
    if edge_servers is not None:
        edge = bench_edge(edge_servers, np.random.default_rng(seed))
    else:
        edge = [
            EdgeServer(
                d.device_id,
                d.capabilities.memory_total_gb,
                min(1.0, d.capabilities.fp32_tflops / 19.5),
            )
            for d in devices
            if d.device_class == "edge_server"
        ]
    with workload.open() as lines:
        try:
            trace = read_itp(lines, limit=limit, load=load)
        except WorkloadError as exc:
            raise SystemExit(f"{workload}: {exc}") from None
    try:
        result = JobSimulation(policy, gpus, edge).run(trace, profiles)
    except MissingProfile as exc:
        raise SystemExit(
            f"{workload}: no throughput profile for {', '.join(exc.models)} in {profiles_dir} "
            f"(it has: {', '.join(exc.known) or 'none'}); add <model>.csv there or pass "
            "--profiles DIR"
        ) from None
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"jobs simulation: {exc}") from None
    done = [j for j in result.jobs if not math.isnan(j.finished_s)]
    return {
        "completed": len(done),
        "failed": len(result.jobs) - len(done),
        "declined": sum(j.declined for j in result.jobs),
        "deadline_satisfaction_ratio": round(result.deadline_satisfaction_ratio, 4),
        "mean_completion_s": round(
            sum(j.finished_s - j.trace.submit_s for j in done) / max(1, len(done)), 1
        ),
        "migration_s": result.migration_s,
        "cloud_gpus": gpus,
        "edge_servers": len(edge),
    }


def run_one(
    workload: Path,
    kind: str,
    fleet: str,
    policy: str,
    mode: Mode,
    load: float,
    seed: int,
    limit: int | None,
    as_json: bool,
    model: str,
    profiles_dir: Path,
    gpus: int | None = None,
    edge_servers: int | None = None,
) -> None:
    if kind == "jobs":
        metrics = run_jobs(
            workload, fleet, policy, load, limit, profiles_dir, gpus, edge_servers, seed
        )
    else:
        reqs = requests(workload, kind, limit, load)
        metrics = summarise(simulate(policy, fleet_spec(fleet), reqs, mode, seed, model))
    if as_json:
        print(json.dumps(metrics))
        return
    rows = [[key, str(value)] for key, value in metrics.items()]
    show(f"{policy} ({mode.value}) on {fleet}", [Column("metric", "left"), Column("value")], rows)


#: Short headers with their units, so a comparison fits a terminal.
SHORT = {
    "throughput_tokens_per_s": "tok/s",
    "latency_p50_s": "p50 s",
    "latency_p99_s": "p99 s",
    "tokens_per_joule": "tok/J",
    "energy_j": "energy J",
    "jain_index": "Jain",
    "decision_p99_us": "decide p99 µs",
    "deadline_satisfaction_ratio": "deadlines met",
    "completed": "done",
}
#: Which columns stay longest when the terminal is narrow.
IMPORTANCE = (
    "throughput_tokens_per_s",
    "latency_p99_s",
    "tokens_per_joule",
    "deadline_satisfaction_ratio",
    "latency_p50_s",
    "completed",
    "failed",
    "energy_j",
)


def print_runs(
    title: str, runs: dict[str, dict[str, float | int]], columns: list[str], wide: bool = False
) -> None:
    header = [Column("policy", "left")]
    for column in columns:
        rank = IMPORTANCE.index(column) + 1 if column in IMPORTANCE else len(IMPORTANCE) + 1
        header.append(Column(SHORT.get(column, column.replace("_", " ")), priority=rank))
    rows = [[name, *(str(metrics[c]) for c in columns)] for name, metrics in runs.items()]
    show(title, header, rows, wide)


def compare(
    workload: Path,
    kind: str,
    fleet: str,
    policies: list[str],
    mode: Mode,
    load: float,
    seed: int,
    limit: int | None,
    as_json: bool,
    plot: Path | None,
    model: str,
    wide: bool,
    profiles_dir: Path,
    gpus: int | None = None,
    edge_servers: int | None = None,
) -> None:
    if kind == "jobs":
        runs_jobs = {
            name: run_jobs(
                workload, fleet, name, load, limit, profiles_dir, gpus, edge_servers, seed
            )
            for name in policies
        }
        if as_json:
            print(json.dumps({"runs": runs_jobs}))
            return
        print_runs(f"jobs on {fleet}", runs_jobs, list(next(iter(runs_jobs.values()))), wide)
        return
    spec, reqs = fleet_spec(fleet), requests(workload, kind, limit, load)
    runs: dict[str, dict[str, float | int]] = {}
    results: dict[str, SimResult] = {}
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=len(policies))
        for name in policies:
            bar.update(task, description=f"simulating {name}")
            results[name] = simulate(name, spec, reqs, mode, seed, model)
            runs[name] = summarise(results[name])
            bar.advance(task)
    if plot is not None:
        from libs.cli.plots import plot_runs

        plot_runs(plot, runs, results)
    if as_json:
        print(json.dumps({"runs": runs}))
        return
    print_runs(f"{len(reqs)} requests on {fleet}, seed {seed}", runs, list(COLUMNS), wide)
