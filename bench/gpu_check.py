"""The GPU check a machine with an NVIDIA GPU runs (under 8 minutes there): llama.cpp built
with CUDA (``deploy/build_llama.sh`` with ``LLAMA_BACKEND=cuda`` into ``.llama-cuda``), a GGUF
made here (random weights, F16 llama), served by llama.cpp's server whole on the CPU (the build
``make llama`` made, hidden from any GPU), whole on the GPU (as many layers as the placement
gives the VRAM a worker announces: ``GPU_SHARE`` of the GPU's memory, less what is in use, read
through NVML as the worker reads it; ``libs/core/partition.py: gpu_part``), split between the
GPU and the CPU of one process (half its layers on each), split between a CPU-only head and a
``ggml-rpc-server`` serving from the GPU (the mixed split of a CPU host and a GPU host), and a
split whose head runs its layers on its GPU with the rest on a CPU-only RPC server, and one
whose CPU head sends the rest to a GPU host's RPC server (its CPU, then its GPU), both with the
workers' own flags (``gpu_command``, ``RpcServer.command``): each one's greedy tokens beside
the CPU run's, and tokens/s.

Where a step cannot run (no CUDA toolkit, no driver listing a GPU) it is reported as skipped
with the reason, and the steps that can run still do; the JSON names every step.

    python bench/gpu_check.py --json [--layers 16 --hidden 1024 --tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
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
    # The script says "building" only when it builds: else the build was in its cache.
    built = "building llama.cpp" in done.stdout
    return {"status": "ran" if built else "cached", "seconds": round(time.monotonic() - started, 1)}


def serve(
    gguf: Path,
    binaries: Path,
    gpu_layers: int,
    tokens: int,
    threads: int,
    rpc: str | None = None,
) -> dict[str, object]:
    """Greedy tokens and decode tokens/s of llama.cpp's server on ``gguf`` (one warm-up
    first): ``gpu_layers`` on the GPU, or on the ``rpc`` server where one is given."""
    from tests.made_models import llama_server

    with llama_server(
        gguf, binaries=binaries, gpu_layers=gpu_layers, threads=threads, timeout_s=180, rpc=rpc
    ) as server:
        server.completion(PROMPT, 4)
        answer = server.completion(PROMPT, tokens, ignore_eos=True)
    timings = answer.get("timings", {})
    return {
        "status": "ran",
        "gpu_layers": gpu_layers,
        "text": answer["content"],
        "tokens": [int(t) for t in answer.get("tokens") or ()],
        "tokens_per_s": round(float(timings.get("predicted_per_second", 0.0)), 1),
    }


def beside_cpu(ran: dict[str, object], cpu: dict[str, object]) -> dict[str, object]:
    """``ran`` with how its greedy tokens compare to the CPU run's: equal, and how many of the
    first agree (a GPU sums in another order: on random weights a near-tie can flip)."""
    mine, theirs = list(ran.pop("tokens")), list(cpu["tokens"])  # type: ignore[call-overload]
    pairs = enumerate(zip(mine, theirs, strict=False))
    agree = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(theirs)))
    return {**ran, "text_equal_cpu": mine == theirs, "tokens_agreeing": f"{agree}/{len(theirs)}"}


@contextlib.contextmanager
def rpc_server(binaries: Path, threads: int, gpu: bool = True) -> Iterator[str]:
    """``ggml-rpc-server`` of ``binaries`` on 127.0.0.1, serving from the GPU (llama.cpp's
    RPC server takes the accelerators it finds before the CPU), or the CPU: its address."""
    from libs.runtime.procs import free_port, wait_for_port
    from services.worker.rpc.server import llama_env

    port = free_port()
    command = [str(binaries / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(
        [*command, "-t", str(threads)], env=llama_env(gpu=gpu),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def gpu_reading() -> dict[str, object] | None:
    """GPU 0 as the worker reads it (NVML), or None where no driver answers."""
    from services.worker.device.gpu import read_gpu

    reading = read_gpu()
    return None if reading is None else {"status": "ran", **asdict(reading)}


def skipped(reason: str) -> dict[str, object]:
    return {"status": "skipped", "reason": reason}


def step(
    run: Callable[..., dict[str, object]], *args: object, **kwargs: object
) -> dict[str, object]:
    """``run``'s report, or its failure's (the steps after it still run)."""
    try:
        return run(*args, **kwargs)
    except Exception as exc:  # a check reports each step's failure rather than stopping
        return {"status": "failed", "error": str(exc)[-2000:]}


GPU_STEPS = (
    "gpu_whole", "gpu_cpu_split", "rpc_gpu_split", "gpu_head_split", "gpu_rpc_worker_split"
)  # fmt: skip


def placed_on_gpu(gguf: Path, total_bytes: int, used_bytes: int) -> int:
    """The layers of ``gguf`` whole (llama.cpp's count, the output layer one of them) that
    the placement gives a GPU of ``total_bytes`` with ``used_bytes`` in use: the worker
    announces ``GPU_SHARE`` of it, the scheduler's view takes what is in use off."""
    from libs.core.catalogue import GB, card_spec
    from libs.core.partition import gpu_part
    from libs.models.gguf_info import read_card
    from services.worker.served.llama_server import GPU_SHARE

    spec = card_spec(read_card(gguf, checksum=False), "llamacpp", slots=1)
    vram_gb = (GPU_SHARE * total_bytes - used_bytes) / GB
    return gpu_part(spec, 0, spec.layers, True, 2048, vram_gb)[0]


def worker_split(
    gguf: Path, cuda: Path, layers: int, tokens: int, threads: int, gpu: list[int | None]
) -> dict[str, object]:
    """A split of ``layers`` in two halves with the flags the workers give llama.cpp
    (``gpu_command``, ``RpcServer.command``): ``gpu`` the layers each half holds on its
    device's GPU (None: a device without one): a head on its GPU before a CPU-only RPC
    server, or a CPU head before a GPU host's RPC server (its CPU, then its GPU)."""
    from libs.contracts import shard_ring
    from libs.runtime.procs import free_port, wait_for_port
    from services.worker.rpc.server import RpcServer
    from services.worker.served.llama_server import gpu_command, layer_split
    from tests.made_models import llama_server

    half = layers // 2
    rpc = RpcServer(cuda, "127.0.0.1", free_port(), threads, gpu=gpu[1] is not None)
    command, env = rpc.command(cuda / "ggml-rpc-server")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", rpc.local_port, 60, proc)
        address = f"127.0.0.1:{rpc.local_port}"
        spans = [("head", 0, half), ("rpc", half, layers)]
        ends = ("127.0.0.1:1", address)  # the head's own: not used
        head = shard_ring("load", "check", "m", spans, 1, 0.0, None, ends, gpu=gpu)[0]
        offload = gpu_command(head, *layer_split(head, layers))
        with llama_server(
            gguf, binaries=cuda, threads=threads, timeout_s=180, rpc=address, offload=offload
        ) as server:
            server.completion(PROMPT, 4)
            answer = server.completion(PROMPT, tokens, ignore_eos=True)
    finally:
        proc.kill()
        proc.wait()
    timings = answer.get("timings", {})
    return {
        "status": "ran",
        "gpu_layers": sum(g or 0 for g in gpu),
        "text": answer["content"],
        "tokens": [int(t) for t in answer.get("tokens") or ()],
        "tokens_per_s": round(float(timings.get("predicted_per_second", 0.0)), 1),
    }


def gpu_steps(
    gguf: Path, cpu: dict[str, object], reading: dict[str, object], args: argparse.Namespace
) -> dict[str, dict[str, object]]:
    """The GGUF whole on the GPU (the layers the placement gives the free memory), half on
    the GPU and half on the CPU of one server, half on a CPU-only head with the rest on an RPC
    server serving from the GPU, and half on a GPU head with the rest on a CPU-only RPC server;
    each beside the CPU run."""
    total, used = (int(str(reading[f"memory_{k}_bytes"])) for k in ("total", "used"))
    whole = placed_on_gpu(gguf, total, used)
    half = args.layers // 2 + 1  # the output layer and the last half of the layers
    cuda, tokens, threads = args.cuda_build, args.tokens, args.threads

    def on_rpc() -> dict[str, object]:
        with rpc_server(cuda, threads) as address:
            return serve(gguf, cuda, half, tokens, threads, rpc=address)

    report: dict[str, dict[str, object]] = {
        "gpu_whole": step(serve, gguf, cuda, whole, tokens, threads),
        "gpu_cpu_split": step(serve, gguf, cuda, half, tokens, threads),
        "rpc_gpu_split": step(on_rpc),
        "gpu_head_split": step(
            worker_split, gguf, cuda, args.layers, tokens, threads, [args.layers // 2, None]
        ),
        "gpu_rpc_worker_split": step(
            worker_split, gguf, cuda, args.layers, tokens, threads, [None, args.layers // 4]
        ),
    }
    report = {
        name: beside_cpu(ran, cpu) if "tokens" in ran else ran for name, ran in report.items()
    }
    if report["gpu_whole"]["status"] == "ran":
        ratio = float(str(report["gpu_whole"]["tokens_per_s"])) / float(str(cpu["tokens_per_s"]))
        report["gpu_over_cpu"] = {"status": "ran", "ratio": round(ratio, 2)}
    return report


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
        reading = None if reason else gpu_reading()
        if reason is None and reading is None:
            reason = "NVML (nvidia-ml-py) read no GPU"
        report["gpu"] = reading or skipped(str(reason))
        build = skipped(str(reason)) if reason else step(build_cuda, args.cuda_build)
        report["cuda_build"] = build
        if build["status"] in ("ran", "cached") and reading is not None:
            report.update(gpu_steps(gguf, cpu, reading, args))
        else:
            why = str(reason or "the CUDA build failed")
            report.update({name: skipped(why) for name in GPU_STEPS})
        cpu.pop("tokens")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        {"step": name, **{k: v for k, v in value.items() if k not in ("text", "tokens")}}
        for name, value in report.items()
        if isinstance(value, dict)
    ]
    write_report(args.results, "gpu_check", "llama.cpp on a GPU against the CPU", table(rows))
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
