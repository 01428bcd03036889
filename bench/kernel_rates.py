"""What llama.cpp's CPU kernels reach on each weight type: the constants of the speed
prediction (``libs/core/predict.py``: ``KERNELS``, ``OP_GFLOP``, ``TOKEN_GFLOP``), measured.

A made model of each type runs whole in a group held to one core (as ``bench/placement.py``
holds a device), at two depths and two widths, each at 1 stream and at ``--streams`` at once.
The group's speed and bandwidth are calibrated again before each run (the machine's neighbours
move them). One fit over every run (``fit``) gives each type's share of the calibrated FP32
rate per token, and the share of the calibrated bandwidth at which a step reads its weights
once (each type's bytes per weight, whatever its streams); the depths tell a layer's own time
from the rest, the widths its weights' part from the part every layer pays (norms, attention,
the graph's own); what is left is each token's own work outside the layers (sampling, the
server's).

    python bench/kernel_rates.py --json [--types Q8_0,Q4_K] [--cpus 1]

Needs root (cgroups) and ``make llama``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from placement import (
    BINARIES,
    PROMPT,
    REPO,
    Candidate,
    HeldDevice,
    calibrate,
    finish,
    held_fleet,
    measure,
)
from report import add_results_option

from libs.cluster.limits import unavailable
from libs.core.predict import BYTES_PER_WEIGHT
from libs.devices.fleetfile import WorkerSpec
from libs.models.gguf_info import read_card
from services.worker.rpc.server import llama_env

#: Weight types, each with what makes it: the ``gguf`` package writes some; llama-quantize
#: makes the others from an F16 file, every tensor of the one type (``--pure``: no mixture).
TYPES = {
    "F32": None, "F16": None, "BF16": None, "Q8_0": None, "Q4_0": None, "Q4_1": None,
    "Q5_0": None, "Q5_1": None, "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M",
    "Q6_K": "Q6_K", "IQ4_XS": "IQ4_XS",
}  # fmt: skip
#: (hidden, ffn) of the wide and the narrow models; multiples of 256 for the K-quants.
WIDE, NARROW = (1024, 2816), (512, 1536)
SHALLOW, DEEP = 8, 32


@dataclass
class Run:
    type: str
    hidden: int
    layers: int
    layer_params: float  # one layer's
    head_params: float
    head_type: str
    layer_types: tuple[str, ...]
    read_gb: float  # the weights a step reads: every layer's and the output's
    gflops: float  # the group's, calibrated just before
    bandwidth_gbps: float
    step_ms: dict[int, float]  # per number of streams: one step (every stream's token)


def made(folder: Path, weight_type: str, hidden: int, ffn: int, layers: int) -> Path:
    """A made llama model whose weight matrices are all of ``weight_type``."""
    sys.path.insert(0, str(REPO))
    from tests.made_models import make_gguf

    heads = hidden // 64
    path = folder / f"{weight_type}-{hidden}-{layers}.gguf"
    quantize_as = TYPES[weight_type]
    if quantize_as is None:
        return make_gguf(path, "llama", weight_type, layers, hidden, heads, heads // 4, ffn)
    source = make_gguf(
        path.with_suffix(".f16"), "llama", "F16", layers, hidden, heads, heads // 4, ffn
    )
    command = [str(BINARIES / "llama-quantize"), "--pure", str(source), str(path), quantize_as]
    done = subprocess.run(command, capture_output=True, text=True, env=llama_env(), timeout=300)
    source.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {quantize_as}: {done.stderr[-500:]}")
    return path


async def one(
    held: HeldDevice, path: Path, file_type: str, prompt: list[int], args: argparse.Namespace
) -> Run:
    card = read_card(path, checksum=False)
    head = card.output_type
    layer = sorted(t for t in card.layer_type_params if t != "F32")  # (the norms')
    read = card.embedding_params * BYTES_PER_WEIGHT[head] + sum(
        n * BYTES_PER_WEIGHT[t] for t, n in card.layer_type_params.items()
    )
    fleet = {held.id: held}
    candidate = Candidate("whole", (held.id,), (card.layers,))
    calibrate(held)
    rates = await measure(fleet, path, card.layers, candidate, prompt, args)
    return Run(
        file_type, card.embedding_params // 49152, card.layers,
        sum(card.layer_params) / card.layers, float(card.embedding_params), head, tuple(layer),
        read / 1e9, held.gflops, held.bandwidth_gbps,
        {n: 1000.0 * n / rate for n, rate in rates.items()},
    )  # fmt: skip


def fit(runs: list[Run], streams: int) -> dict[str, object]:
    """The constants from the runs, fitted to every run at once (least squares on relative
    error, none negative), at each run's own calibration (GFLOP/s ``g``, GB/s ``b``). A step
    of ``n`` streams takes

        read GB / (b × read_share)                                   (weights read once)
        + Σ over matrices 2 × weights × n / (g × share)              (each type its share)
        + (layers × (op_step + op_stream × n) + token_step + token_stream × n) / g
    """
    import numpy as np
    from scipy.optimize import nnls

    types = list(dict.fromkeys(r.type for r in runs))
    rows, unmeasured = [], 0
    for r in runs:
        for n in (1, streams):
            if not math.isfinite(r.step_ms[n]) or r.step_ms[n] <= 0:
                unmeasured += 1  # no decode window (a stream cut short): left out of the fit
                continue
            row = np.zeros(1 + len(types) + 4)
            row[0] = r.read_gb / r.bandwidth_gbps
            for name, gflop in ((r.type, 2 * r.layers * r.layer_params / 1e9),
                                (r.head_type, 2 * r.head_params / 1e9)):  # fmt: skip
                row[1 + types.index(name if name in types else r.type)] += gflop * n / r.gflops
            row[-4:] = np.array((r.layers, r.layers * n, 1.0, n)) / r.gflops
            rows.append(row / (r.step_ms[n] / 1e3))
    if not rows:
        sys.exit("kernel rates bench: no run measured a decode window (give more --tokens)")
    solution, _ = nnls(np.array(rows), np.ones(len(rows)))
    misses = np.abs(np.array(rows) @ solution - 1.0)
    shares = solution[1 : 1 + len(types)]
    kernels = {t: round(1 / x, 3) for t, x in zip(types, shares, strict=True) if x > 0}
    op_step, op_stream, token_step, token_stream = solution[-4:]
    return {
        "kernels": kernels,
        "read_share": round(1 / solution[0], 3) if solution[0] > 0 else None,
        "gbps_per_gflops": round(statistics.median(r.bandwidth_gbps / r.gflops for r in runs), 3),
        "op_gflop": {"step": round(op_step, 5), "stream": round(op_stream, 5)},
        "token_gflop": {"step": round(token_step, 5), "stream": round(token_stream, 5)},
        "fit_error_median": round(float(np.median(misses)), 3),
        "fit_error_max": round(float(misses.max()), 3),
        "unmeasured": unmeasured,
    }


async def run(args: argparse.Namespace, folder: Path) -> dict[str, object]:
    from transformers import AutoTokenizer

    from libs.models.chat import encode_chat
    from libs.models.shipped import prepare

    tokenizer = AutoTokenizer.from_pretrained(prepare())
    prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    spec = WorkerSpec(id="core", device_class="laptop", cpus=args.cpus, memory_gb=4.0)
    runs: list[Run] = []
    with held_fleet([spec], secrets.token_hex(3)) as held:
        for file_type in args.types:
            for hidden, ffn in (WIDE, NARROW):
                for layers in (SHALLOW, DEEP):
                    path = made(folder, file_type, hidden, ffn, layers)
                    runs.append(await one(held[0], path, file_type, prompt, args))
                    path.unlink()
                    r = runs[-1]
                    print(
                        f"{file_type} {hidden}x{layers}: "
                        + ", ".join(f"c{n} {ms:.2f} ms/step" for n, ms in r.step_ms.items()),
                        file=sys.stderr,
                    )
    rows = [
        {
            "type": r.type, "hidden": r.hidden, "layers": r.layers,
            "layer types": ",".join(r.layer_types), "head type": r.head_type,
            "gflops": round(r.gflops, 1), "gbps": round(r.bandwidth_gbps, 1),
            **{f"c{n} ms/step": round(ms, 3) for n, ms in r.step_ms.items()},
        }
        for r in runs
    ]  # fmt: skip
    return {
        "bench": "kernel_rates",
        "cpus": args.cpus,
        "gflops_median": round(statistics.median(r.gflops for r in runs), 1),
        "streams": args.streams,
        **fit(runs, args.streams),
        "runs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", type=lambda s: s.split(","), default=list(TYPES))  # fmt: skip
    parser.add_argument("--cpus", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    if unknown := set(args.types) - set(TYPES):
        sys.exit(
            f"kernel rates bench: unknown type(s) {sorted(unknown)}: one of {', '.join(TYPES)}"
        )
    if why := unavailable():
        sys.exit(f"kernel rates bench: {why}")
    if not (BINARIES / "llama-server").exists():
        sys.exit("kernel rates bench: llama.cpp not built (make llama)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kernels-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    title = "llama.cpp's CPU kernels per weight type"
    finish(args, result, started, "kernel_rates", title, "runs")


if __name__ == "__main__":
    main()
