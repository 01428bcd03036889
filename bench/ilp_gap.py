"""How far each heuristic is from the exact optimum of mean completion time.

Random small instances (2–12 jobs × 2–5 machines, release times, memory limits); each
heuristic runs online (list scheduling); the optimum comes from the MILP (HiGHS). Prints the
mean and spread of each policy's gap, the share of instances solved to proven optimality, and
whether the optimum was ever beaten (it must not be).

    python bench/ilp_gap.py --instances 200 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.harness.reference import optimum, random_instance, run_policy

POLICIES = [
    "dwps",
    "dynamic",
    "least_connections",
    "sjf",
    "power_of_two",
    "round_robin",
    "consistent_hash",
    "random",
]


def run(instances: int, max_jobs: int, max_machines: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    gaps: dict[str, list[float]] = {name: [] for name in POLICIES}
    proven, beaten, solve_s = 0, 0, []
    for index in range(instances):
        instance = random_instance(rng, max_jobs, max_machines)
        started = time.perf_counter()
        best = optimum(instance)
        solve_s.append(time.perf_counter() - started)
        proven += best.proven_optimal
        for name in POLICIES:
            value = run_policy(name, instance).mean_completion
            gap = value / best.mean_completion - 1.0
            beaten += best.proven_optimal and gap < -1e-4
            gaps[name].append(gap)
        print(f"\r{index + 1}/{instances} instances", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {
        "instances": instances,
        "max_jobs": max_jobs,
        "max_machines": max_machines,
        "proven_optimal_share": proven / instances,
        "optimum_beaten": beaten,
        "solve_s_p50": float(np.percentile(solve_s, 50)),
        "solve_s_max": float(max(solve_s)),
        "mean_gap": {n: round(float(np.mean(g)), 4) for n, g in gaps.items()},
        "gap_std": {n: round(float(np.std(g)), 4) for n, g in gaps.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--max-jobs", type=int, default=12)
    parser.add_argument("--max-machines", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args(argv)
    report = run(args.instances, args.max_jobs, args.max_machines, args.seed)
    write_report(
        args.results,
        "ilp_gap",
        "The heuristics against the exact optimum of mean completion time",
        table(report),
    )
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
