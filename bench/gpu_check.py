"""The GPU check a machine with an NVIDIA GPU runs (under 8 minutes there): llama.cpp built
with CUDA (``deploy/build_llama.sh`` with ``LLAMA_BACKEND=cuda`` into ``.llama-cuda``), a GGUF
made here (random weights, F16 llama), served by llama.cpp's server whole on the CPU (the CPU
build, as the llamacpp worker runs it), whole on the GPU and split between the GPU and the CPU
(half its layers on each): each one's greedy text beside the CPU run's, and tokens/s.

Where a step cannot run (no CUDA toolkit, no driver listing a GPU) it is reported as skipped
with the reason, and the steps that can run still do; the JSON names every step.

    python bench/gpu_check.py --json [--layers 16 --hidden 1024 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import add_results_option, table, write_report  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT = "The quick brown fox"


def why_no_cuda() -> str | None:
    """Why ``make llama``'s rule would not build llama.cpp with CUDA here (None: it would):
    deploy/build_llama.sh's own plan (``BUILD_LLAMA_SHOW``), so the check and the build agree."""
    plan = subprocess.run(
        ["bash", str(REPO / "deploy" / "build_llama.sh"), "-"],
        env={**os.environ, "BUILD_LLAMA_SHOW": "1", "LLAMA_BACKEND": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = re.match(r"backend=(\w+) \((.*)\) flags=", plan)
    if found is None:
        raise RuntimeError(f"deploy/build_llama.sh's plan unread: {plan!r}")
    return None if found[1] == "cuda" else found[2]


def build_cuda(folder: Path) -> dict[str, object]:
    """``deploy/build_llama.sh`` for CUDA into ``folder`` (cached as every build is)."""
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(REPO / "deploy" / "build_llama.sh"), str(folder)],
        env={**os.environ, "LLAMA_BACKEND": "cuda"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the CUDA build failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return {"status": "ran", "seconds": round(time.monotonic() - started, 1)}


def serve(
    gguf: Path, binaries: Path, gpu_layers: int, tokens: int, threads: int
) -> dict[str, object]:
    """Greedy text and decode tokens/s of llama.cpp's server on ``gguf`` (one warm-up first)."""
    from tests.made_models import llama_server

    with llama_server(
        gguf, binaries=binaries, gpu_layers=gpu_layers, threads=threads, timeout_s=120
    ) as server:
        server.completion(PROMPT, 4)
        answer = server.completion(PROMPT, tokens, ignore_eos=True)
    timings = answer.get("timings", {})
    return {
        "status": "ran",
        "gpu_layers": gpu_layers,
        "text": answer["content"],
        "tokens_per_s": round(float(timings.get("predicted_per_second", 0.0)), 1),
    }


def skipped(reason: str) -> dict[str, object]:
    return {"status": "skipped", "reason": reason}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cuda-build", type=Path, default=REPO / ".llama-cuda")
    parser.add_argument("--json", action="store_true", help="print the report as indented JSON")
    add_results_option(parser)
    args = parser.parse_args()
    from tests.made_models import llama_binaries, make_gguf

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    report: dict[str, object] = {}
    try:
        gguf = make_gguf(
            work / "check.gguf", "llama", "F16", layers=args.layers, hidden=args.hidden,
            heads=16, kv_heads=4, ffn=4 * args.hidden,
        )  # fmt: skip
        report["model"] = f"llama F16, {args.layers} layers, {gguf.stat().st_size / 1e6:.0f} MB"
        cpu = serve(gguf, llama_binaries(), 0, args.tokens, args.threads)
        report["cpu"] = cpu
        reason = why_no_cuda()
        report["cuda_build"] = skipped(reason) if reason else build_cuda(args.cuda_build)
        for step, layers in (("gpu_whole", args.layers + 1), ("gpu_cpu_split", args.layers // 2)):
            if reason:
                report[step] = skipped(reason)
                continue
            ran = serve(gguf, args.cuda_build, layers, args.tokens, args.threads)
            ran["text_equal_cpu"] = ran["text"] == cpu["text"]
            report[step] = ran
        whole = report["gpu_whole"]
        if isinstance(whole, dict) and whole.get("status") == "ran":
            report["gpu_over_cpu"] = round(
                float(whole["tokens_per_s"]) / max(float(str(cpu["tokens_per_s"])), 1e-9), 2
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        {"step": name, **{k: v for k, v in value.items() if k != "text"}}
        for name, value in report.items()
        if isinstance(value, dict)
    ]
    write_report(args.results, "gpu_check", "llama.cpp on a GPU against the CPU", table(rows))
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
