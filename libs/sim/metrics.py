"""Metrics of a simulated run (the keys `tessera simulate --json` prints)."""

from __future__ import annotations

import math

import numpy as np

from libs.sim.serving import SimResult


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0 or not x.any():
        return 1.0
    return float(x.sum() ** 2 / (len(x) * (x**2).sum()))


#: The latency a request may take to count as served well: a 2 s start, then a reader's pace
#: of 10 tokens/s (SLOs scaled by output length, as serving papers state them).
SLO_BASE_S = 2.0
SLO_PER_TOKEN_S = 0.1


def slo_s(output_tokens: int) -> float:
    return SLO_BASE_S + SLO_PER_TOKEN_S * output_tokens


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarise(result: SimResult) -> dict[str, float | int]:
    done = [o for o in result.outcomes if o.completed]
    latency = np.array([o.done_s - o.request.arrival_s for o in done])
    wait = np.array([o.start_s - o.request.arrival_s for o in done])
    tokens = sum(o.request.output_tokens for o in done)
    energy = sum(d.emulated.energy_j for d in result.devices)
    span = max(result.makespan_s, 1e-9)
    utilisation = [d.busy_s / span for d in result.devices]
    deadlines = [o for o in result.outcomes if o.request.deadline_s is not None]
    met = sum(1 for o in deadlines if o.completed and o.done_s <= (o.request.deadline_s or 0))
    decisions = np.asarray(result.decision_s) * 1e6
    within = sum(
        1 for o in done if o.done_s - o.request.arrival_s <= slo_s(o.request.output_tokens)
    )
    return {
        "completed": len(done),
        "failed": len(result.outcomes) - len(done),
        "throughput_tokens_per_s": round(tokens / span, 3),
        "latency_p50_s": round(_pct(latency, 50), 4),
        "latency_p99_s": round(_pct(latency, 99), 4),
        "mean_wait_s": round(float(wait.mean()) if len(wait) else math.nan, 4),
        "mean_completion_s": round(float(latency.mean()) if len(latency) else math.nan, 4),
        "energy_j": round(energy, 1),
        "tokens_per_joule": round(tokens / energy, 6) if energy else 0.0,
        "deadline_satisfaction_ratio": round(met / len(deadlines), 4) if deadlines else 1.0,
        "slo_attainment": round(within / len(result.outcomes), 4) if result.outcomes else 1.0,
        "jain_index": round(jain_index(utilisation), 4),
        "decision_p99_us": round(_pct(decisions, 99), 2),
        "simulated_s": round(span, 1),
        "wall_s": round(result.wall_s, 3),
    }
