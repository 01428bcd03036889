"""Workloads: the Azure LLM inference trace, synthetic Poisson and bursty arrivals.

Readers take lines of CSV text (the caller opens the file), so any CSV with the same columns —
a user's own trace — works the same way. ``load`` compresses inter-arrival times (2.0: twice
the request rate); ``time_scale`` stretches them.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import numpy as np

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    source: str = ""
    deadline_s: float | None = None


class WorkloadError(ValueError):
    pass


def _timestamp(text: str) -> float:
    # Azure writes 7 fractional digits; datetime takes at most 6.
    head, _, fraction = text.strip().partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + (float("0." + fraction) if fraction else 0.0)


def read_azure(
    lines: Iterable[str], *, limit: int | None = None, load: float = 1.0, time_scale: float = 1.0
) -> list[Request]:
    """Requests of an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens),
    arrivals in seconds from the first request. Raises ``WorkloadError`` naming the bad row."""
    if load <= 0 or time_scale <= 0:
        raise WorkloadError("load and time_scale must be positive")
    reader = csv.DictReader(lines)
    missing = set(AZURE_COLUMNS) - set(reader.fieldnames or ())
    if missing:
        raise WorkloadError(f"not an Azure LLM trace: missing columns {sorted(missing)}")
    requests: list[Request] = []
    start: float | None = None
    for row_number, row in enumerate(reader, start=2):
        if limit is not None and len(requests) >= limit:
            break
        try:
            at = _timestamp(row["TIMESTAMP"])
            prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"row {row_number}: {exc}") from None
        if prompt < 0 or output < 0:
            raise WorkloadError(f"row {row_number}: negative token count")
        start = at if start is None else start
        arrival = (at - start) * time_scale / load
        requests.append(
            Request(
                f"r{len(requests)}",
                arrival,
                prompt,
                max(1, output),
                source=f"s{len(requests) % 97}",
            )
        )
    return sorted(requests, key=lambda r: r.arrival_s)


def poisson(
    rate_per_s: float,
    count: int,
    rng: np.random.Generator,
    *,
    prompt_mean: float = 1000.0,
    output_mean: float = 100.0,
) -> list[Request]:
    """``count`` requests with exponential inter-arrival times and geometric token counts."""
    if rate_per_s <= 0 or count < 0:
        raise WorkloadError("rate must be positive and count not negative")
    gaps = rng.exponential(1.0 / rate_per_s, count)
    prompts = rng.geometric(1.0 / prompt_mean, count)
    outputs = rng.geometric(1.0 / output_mean, count)
    arrivals = np.cumsum(gaps)
    return [
        Request(f"r{i}", float(arrivals[i]), int(prompts[i]), int(outputs[i]), f"s{i % 97}")
        for i in range(count)
    ]


def bursty(
    rate_per_s: float, count: int, rng: np.random.Generator, *, burst: int = 20, **tokens: float
) -> list[Request]:
    """Poisson bursts of ``burst`` simultaneous requests at ``rate_per_s / burst`` bursts/s."""
    base = poisson(rate_per_s / burst, (count + burst - 1) // burst, rng, **tokens)
    out: list[Request] = []
    for b in base:
        for k in range(burst):
            if len(out) < count:
                out.append(
                    Request(
                        f"r{len(out)}",
                        b.arrival_s,
                        b.prompt_tokens,
                        b.output_tokens,
                        f"s{(len(out) + k) % 97}",
                    )
                )
    return out
