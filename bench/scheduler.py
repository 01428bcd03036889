"""Decision speed of the full DWPS pipeline against three references, measured in one run.

For each fleet size: placements/s and p50/p99 per-decision latency of DWPS (filters, scores,
priorities, load updates, i.e. ``Dwps.place`` on cycles of tasks; on a large fleet it searches
the fleet's blocks, ``libs/core/search.py``), and on the same devices and tasks:
* the same pipeline scoring every device (``FleetState(block_size=None)``), with whether it
  made the same decisions, device and score, for every task;
* the bare kernel: numpy cosine similarity + argmax, nothing else;
* a straightforward per-device Python loop computing balanced mode's filters and scores.
The process's peak resident memory so far is given with each size.

    python bench/scheduler.py --devices 10000 --json          # 100, 1,000 and 10,000 devices
    python bench/scheduler.py --devices 10000 100000 --json   # exactly these sizes
"""

from __future__ import annotations

import os

from report import add_results_option, table, write_report  # bench/ is the script's folder

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the goal is for one core
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import resource
import sys
import time

import numpy as np

from libs.core import energy
from libs.core.blocks import BLOCK_SIZE
from libs.core.dwps import Dwps
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Placement, Task
from libs.sim.random_fleets import random_fleet, random_tasks

#: The largest fleet the bench builds (its devices are Python objects: about 1 KB each).
MAX_DEVICES = 100_000


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e6, q))


def bench_dwps(
    devices: list[Device], tasks: list[Task], cycle: int, block_size: int | None = BLOCK_SIZE
) -> tuple[dict[str, float], list[Placement]]:
    latencies: list[float] = []
    policy = Dwps(observer=lambda placement, seconds: latencies.append(seconds))
    fleet = FleetState(devices, block_size=block_size)
    placements: list[Placement] = []
    started = time.perf_counter()
    for i in range(0, len(tasks), cycle):
        placements += policy.place(fleet, tasks[i : i + cycle], 0.0, np.random.default_rng(0))
    elapsed = time.perf_counter() - started
    figures = {
        "placements_per_s": len(tasks) / elapsed,
        "p50_us": percentile_us(latencies, 50),
        "p99_us": percentile_us(latencies, 99),
        "placed_share": sum(p.placed for p in placements) / len(tasks),
    }
    return figures, placements


def bench_kernel(devices: list[Device], tasks: list[Task]) -> float:
    capability = np.array([d.capability for d in devices])
    norms = np.linalg.norm(capability, axis=1)
    demands = [np.asarray(t.demand) for t in tasks]
    started = time.perf_counter()
    for demand in demands:
        similarity = (capability @ demand) / (norms * np.linalg.norm(demand))
        int(np.argmax(similarity))
    return len(tasks) / (time.perf_counter() - started)


def naive_pick(
    devices: list[Device], task: Task, load: list[float], wait: list[float]
) -> int | None:
    """Balanced mode's filters and scores, one device at a time in plain Python: match 0.2,
    capability total 0.1, completion 0.7 (earliest ÷ this device's), × battery × heat."""
    finish = [wait[i] + task.work / d.speed for i, d in enumerate(devices)]
    earliest = min((f for f, d in zip(finish, devices, strict=True) if not d.failed), default=0.0)
    best, best_score = None, -math.inf
    demand_norm = math.sqrt(sum(x * x for x in task.demand))
    for i, d in enumerate(devices):
        if d.failed or d.memory_free_gb < task.memory_gb:
            continue
        if (
            energy.max_intensity_for_power(d.power_idle_w, d.power_max_w, d.power_now_w)
            < task.intensity
        ):
            continue
        if (
            energy.max_intensity_for_heat(d.temperature_c, d.delta_t_c, d.thermal_limit_c)
            <= task.intensity
        ):
            continue
        cap_norm = math.sqrt(sum(x * x for x in d.capability))
        match = sum(a * b for a, b in zip(d.capability, task.demand, strict=True)) / (
            cap_norm * demand_norm
        )
        total = sum(a * b for a, b in zip(d.capability, (0.3, 0.2, 0.2, 0.15, 0.15), strict=True))
        completion = max(earliest, 1e-12) / max(finish[i], 1e-12)
        battery = min(1.0, (d.battery_percent or 100.0) / 20.0) if d.on_battery else 1.0
        thermal = min(1.0, max(0.0, (d.thermal_limit_c - d.temperature_c) / 10.0))
        score = (0.2 * match + 0.1 * total + 0.7 * completion) * battery * thermal
        if score > best_score:
            best, best_score = i, score
    if best is not None:
        slots = devices[best].slots
        if load[best] + 1.0 / slots >= 1.0 - 1e-9:  # its last free slot: later tasks wait
            wait[best] += task.work / devices[best].speed / slots
        load[best] += 1.0 / slots
    return best


def bench_naive(devices: list[Device], tasks: list[Task]) -> float:
    load = [d.load for d in devices]
    wait = [0.0 for _ in devices]
    started = time.perf_counter()
    for task in tasks:
        naive_pick(devices, task, load, wait)
    return len(tasks) / (time.perf_counter() - started)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sizes(devices: list[int]) -> list[int]:
    """One size: the standard sizes up to it (or it alone); several: exactly those."""
    if len(devices) > 1:
        return devices
    standard = [s for s in (100, 1_000, 10_000, 100_000) if s <= devices[0]]
    return standard if devices[0] in standard else [*standard, devices[0]]


def run(fleet_sizes: list[int], tasks_per_size: int, cycle: int, seed: int) -> dict[str, object]:
    results = []
    for n in fleet_sizes:
        rng = np.random.default_rng(seed)
        devices = random_fleet(n, rng)
        tasks = random_tasks(tasks_per_size, rng)
        dwps, decided = bench_dwps(devices, tasks, cycle)
        every, reference = bench_dwps(devices, tasks, cycle, block_size=None)
        same = [(p.device_id, p.score) for p in decided] == [
            (p.device_id, p.score) for p in reference
        ]
        kernel = bench_kernel(devices, tasks)
        naive_tasks = tasks[: max(20, min(len(tasks), 2_000_000 // n))]
        naive = bench_naive(devices, naive_tasks)
        results.append(
            {
                "devices": n,
                "placements_per_s": round(dwps["placements_per_s"], 1),
                "p50_us": round(dwps["p50_us"], 1),
                "p99_us": round(dwps["p99_us"], 1),
                "placed_share": round(dwps["placed_share"], 3),
                "every_device_placements_per_s": round(every["placements_per_s"], 1),
                "every_device_p50_us": round(every["p50_us"], 1),
                "every_device_p99_us": round(every["p99_us"], 1),
                "every_device_ratio": round(
                    dwps["placements_per_s"] / every["placements_per_s"], 2
                ),
                "same_decisions": same,
                "kernel_placements_per_s": round(kernel, 1),
                "kernel_ratio": round(dwps["placements_per_s"] / kernel, 3),
                "naive_placements_per_s": round(naive, 1),
                "naive_ratio": round(dwps["placements_per_s"] / naive, 1),
                "peak_rss_mb": round(peak_rss_mb(), 1),
            }
        )
    return {"cycle_tasks": cycle, "tasks_per_size": tasks_per_size, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=[10_000],
        help=f"fleet sizes, up to {MAX_DEVICES:,} (one: the standard sizes up to it)",
    )
    parser.add_argument("--tasks", type=int, default=5_000, help="tasks placed per fleet size")
    parser.add_argument("--cycle", type=int, default=500, help="tasks per decision cycle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_results_option(parser)
    args = parser.parse_args(argv)
    if min(args.devices) < 1 or args.tasks < 1 or args.cycle < 1:
        parser.error("--devices, --tasks and --cycle must be positive")
    if max(args.devices) > MAX_DEVICES:
        parser.error(f"--devices goes up to {MAX_DEVICES:,}")
    report = run(sizes(args.devices), args.tasks, args.cycle, args.seed)
    write_report(
        args.results, "scheduler", "Decision speed of the DWPS pipeline", table(report["results"])
    )
    if args.json:
        print(json.dumps(report))
    else:
        for row in report["results"]:  # type: ignore[attr-defined]
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
