"""One-off calibration of this host: FP32 GFLOP/s, INT8 op/s and memory bandwidth.

Short numpy kernels (about 3 s in all on a 2-core VM), each repeated and the best run kept;
the result is cached per host name, so later starts read the file instead.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

Progress = Callable[[str, int, int], None]
"""``progress(step_name, done, total)``."""


@dataclass(frozen=True)
class Calibration:
    fp32_gflops: float
    int8_gops: float
    memory_bandwidth_gbps: float
    seconds: float
    host: str


#: Runs of each kernel before a sustained rate is timed.
WARM_UP_RUNS = 3


def _best_rate(work: float, run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return work / best


def _sustained_rate(work: float, run: Callable[[], object], seconds: float) -> float:
    """Work per second over runs one after another for at least ``seconds``, after
    ``WARM_UP_RUNS`` not counted: a copy's first run faults in its destination's every page,
    and under a quarter-core quota one second of copies read 0.8–5.5 GB/s with it counted,
    4.3–5.5 after one run not counted and 4.7–5.1 after three (one core: 19–22)."""
    for _ in range(WARM_UP_RUNS):
        run()
    started, runs = time.perf_counter(), 0
    while True:
        run()
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return work * runs / elapsed


def measure(
    progress: Progress | None = None,
    size: int = 1024,
    repeats: int = 3,
    sustained_s: float | None = None,
) -> Calibration:
    """``sustained_s``: each rate over that many seconds of runs instead of the best of
    ``repeats`` short ones, for a process under a CPU quota (``libs/cluster/limits.py``),
    whose short runs go at full speed until its quota of the period is spent."""
    if sustained_s is not None:
        seconds = sustained_s

        def rate(work: float, run: Callable[[], object], repeats: int) -> float:
            return _sustained_rate(work, run, seconds)
    else:
        rate = _best_rate
    report = progress or (lambda *_: None)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    report("fp32 matmul", 0, 3)
    a = rng.random((size, size), dtype=np.float32)
    b = rng.random((size, size), dtype=np.float32)
    fp32 = rate(2.0 * size**3, lambda: a @ b, repeats) / 1e9
    report("int8 matmul", 1, 3)
    small = size // 4  # numpy's integer matmul has no BLAS: keep it short
    ai = rng.integers(-128, 127, (small, small), dtype=np.int8).astype(np.int32)
    bi = rng.integers(-128, 127, (small, small), dtype=np.int8).astype(np.int32)
    int8 = rate(2.0 * small**3, lambda: ai @ bi, repeats) / 1e9
    report("memory copy", 2, 3)
    src = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB
    dst = np.empty_like(src)
    bandwidth = rate(2.0 * src.nbytes, lambda: np.copyto(dst, src), repeats) / 1e9
    report("done", 3, 3)
    return Calibration(fp32, int8, bandwidth, time.perf_counter() - started, socket.gethostname())


def cached(cache_dir: Path, progress: Progress | None = None) -> Calibration:
    """The cached calibration of this host, measuring it first if there is none."""
    path = cache_dir / f"calibration-{socket.gethostname()}.json"
    if path.exists():
        try:
            return Calibration(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            path.unlink()  # unreadable: measure again
    result = measure(progress)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # processes calibrating at once
    partial.write_text(json.dumps(asdict(result)))
    partial.replace(path)
    return result
