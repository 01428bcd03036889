"""PNG charts of a policy comparison (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from libs.sim.serving import SimResult

CHARTS = {
    "throughput_tokens_per_s": "throughput (tokens/s)",
    "latency_p99_s": "p99 latency (s)",
    "tokens_per_joule": "tokens per joule",
    "deadline_satisfaction_ratio": "deadline satisfaction ratio",
}


def plot_runs(
    folder: Path, runs: dict[str, dict[str, float | int]], results: dict[str, SimResult]
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    names = list(runs)
    for key, label in CHARTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, [float(runs[n][key]) for n in names], color="#4477aa")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        path = folder / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, result in results.items():
        shares = sorted(
            (d.busy_s / max(result.makespan_s, 1e-9) for d in result.devices), reverse=True
        )
        ax.plot(range(len(shares)), shares, label=name)
    ax.set_xlabel("devices, busiest first")
    ax.set_ylabel("utilisation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "utilisation.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [*written, path]
