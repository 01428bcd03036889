"""Energy mode against performance mode on traces no constant was chosen on.

Poisson arrivals at three rates with other prompt and output lengths than the Azure trace's,
on seed fleets other than ``bench/policies.py``'s (seeds 10–12): the share of energy energy
mode saves, its throughput and its p99, each relative to performance mode.

    python bench/energy_unseen.py --json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.contracts import Mode
from libs.core.policies import make_policy
from libs.core.profiles import BUILTIN_PROFILES
from libs.devices.fleetfile import build, load_fleet
from libs.sim.fleets import BUILTIN
from libs.sim.metrics import summarise
from libs.sim.serving import ServingSimulation
from libs.sim.workloads import poisson

MODEL = "llama-3.2-1b-instruct"
#: (requests per second, mean prompt tokens, mean output tokens)
WORKLOADS = ((0.5, 500, 200), (2.0, 1500, 60), (6.0, 800, 120))


def compare(rate: float, prompt: int, output: int, seeds: int, count: int) -> dict[str, float]:
    runs: dict[Mode, list[dict[str, float]]] = {Mode.PERFORMANCE: [], Mode.ENERGY: []}
    for seed in range(seeds):
        rng = np.random.default_rng(100 + seed)
        requests = poisson(rate, count, rng, prompt_mean=prompt, output_mean=output)
        for mode, out in runs.items():
            fleet = build(load_fleet({**BUILTIN["seed"], "seed": 10 + seed}))
            policy = make_policy("dwps", BUILTIN_PROFILES[mode])
            sim = ServingSimulation(fleet, policy, model=MODEL, seed=seed)
            out.append({k: float(v) for k, v in summarise(sim.run(requests)).items()})

    def mean(mode: Mode, key: str) -> float:
        return float(np.mean([r[key] for r in runs[mode]]))

    def share(key: str) -> float:
        return mean(Mode.ENERGY, key) / mean(Mode.PERFORMANCE, key)

    return {
        "energy_saving": round(1 - share("energy_j"), 3),
        "throughput_ratio": round(share("throughput_tokens_per_s"), 4),
        "p99_ratio": round(share("latency_p99_s"), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    report = {
        f"poisson {rate}/s, prompt {prompt}, output {output}": compare(
            rate, prompt, output, args.seeds, args.requests
        )
        for rate, prompt, output in WORKLOADS
    }
    write_report(
        args.results,
        "energy_unseen",
        "Energy mode on traces no constant was chosen on",
        table([{"workload": workload, **figures} for workload, figures in report.items()]),
    )
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
