"""Which engines a machine runs, by one rule for ``tessera up`` (with or without ``--listen``)
and ``tessera join``: llama.cpp wherever ``make llama`` built it; torch shards only when asked
(or where nothing faster is built, saying how to build it); a vLLM worker beside them where an
NVIDIA GPU and vLLM's GPU build are here. ``--engine`` naming an engine this host has not built
is refused with the command that builds it.

The rule (``cpu_engine``, ``vllm_workers``, ``joined_engine``) is pure: it reads a ``Built``,
which ``Built.here`` takes from this host (the build stamps, the driver's GPU list)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libs.models.engine_support import is_vllm_cpu_build, llama_build, vllm_build

REPO = Path(__file__).resolve().parents[2]
#: One folder per GPU the NVIDIA driver sees.
GPUS = Path("/proc/driver/nvidia/gpus")
BUILD_LLAMA = "`make llama` builds it (~5 min, once)"


class EngineMissing(ValueError):
    """``--engine`` named an engine this host has not built; the message says why and how to
    build it (the caller names the flag)."""


@dataclass(frozen=True)
class Built:
    """What this host has: the engines built and an NVIDIA GPU."""

    #: llama.cpp's server and RPC server (``make llama``); ``llama_backend`` what it was
    #: built for: ``cuda`` where the toolkit was (deploy/build_llama.sh), else ``cpu``.
    llamacpp: bool = False
    llama_backend: str = "cpu"
    #: vLLM's virtualenv (``make vllm``) and which package: ``vllm-cpu…`` is the CPU build.
    vllm: str = ""
    gpu: bool = False

    @property
    def vllm_gpu(self) -> bool:
        return bool(self.vllm) and not is_vllm_cpu_build(self.vllm)

    @classmethod
    def here(cls, repo: Path = REPO, gpus: Path = GPUS) -> Built:
        llama = llama_build(repo / ".llama")
        return cls(
            llamacpp=llama is not None,
            llama_backend=llama[1] if llama else "cpu",
            vllm=vllm_build(repo / ".venv-vllm"),
            gpu=gpus.is_dir() and any(gpus.iterdir()),
        )


def llama_note(built: Built) -> str:
    if built.llama_backend == "cuda":
        return "llama.cpp, built with CUDA"
    return "llama.cpp"


def checked(asked: str, built: Built) -> str:
    """``asked`` if this host has it built; EngineMissing naming the fix otherwise."""
    if asked == "llamacpp" and not built.llamacpp:
        raise EngineMissing(f"llama.cpp is not built on this host: {BUILD_LLAMA}")
    if asked == "vllm" and not built.vllm:
        raise EngineMissing(
            "vLLM is not installed on this host: `VLLM_PACKAGE=vllm make vllm` (an NVIDIA GPU) "
            "or `make vllm` (its CPU build)"
        )
    return asked


def cpu_engine(asked: str | None, built: Built) -> tuple[str, str]:
    """The CPU workers' engine of ``tessera up`` and why: what was asked, else llama.cpp where
    built (bench/serving.py: the faster one here; it runs any GGUF its build reads), else torch.
    Whether others join (``--listen``) changes nothing: joined hosts follow the same rule."""
    if asked is not None:
        return checked(asked, built), f"CPU workers run {asked}, as asked"
    if built.llamacpp:
        return "llamacpp", f"CPU workers run {llama_note(built)} (its RPC backend splits a model)"
    return "torch", f"CPU workers run torch shards: llama.cpp is not built here ({BUILD_LLAMA})"


def vllm_workers(asked: int | None, built: Built) -> tuple[int, str]:
    """vLLM workers ``tessera up`` starts and why.

    Measured on CPU (bench/serving.py): the CPU engines serve SmolLM2 as fast as vLLM's CPU
    build or faster, and they split a model, which vLLM cannot; so a machine without a GPU
    runs CPU workers only. With an NVIDIA GPU and vLLM's GPU build, one vLLM worker beside."""
    if asked is not None:
        return asked, f"{asked} vLLM worker(s), as asked"
    if not built.gpu:
        return 0, "no NVIDIA GPU: no vLLM worker (the CPU workers split models, vLLM does not)"
    if not built.vllm_gpu:
        why = "no vLLM GPU build (`VLLM_PACKAGE=vllm make vllm`)"
        return 0, f"an NVIDIA GPU but {why}: CPU workers only"
    return 1, "an NVIDIA GPU: one vLLM worker for whole models beside the CPU workers"


def joined_engine(asked: str | None, built: Built) -> tuple[str, str]:
    """The engine of a joined host's one worker and why: what was asked, else llama.cpp where
    built (its RPC server takes a split's layers; with CUDA, on the GPU), else vLLM where a GPU
    and its GPU build are (whole models), else torch shards."""
    if asked is not None:
        return checked(asked, built), "as asked"
    if built.llamacpp:
        return "llamacpp", f"{llama_note(built)} is built here"
    if built.gpu and built.vllm_gpu:
        return "vllm", f"an NVIDIA GPU and vLLM's GPU build; llama.cpp is not built ({BUILD_LLAMA})"
    return "torch", f"llama.cpp is not built here ({BUILD_LLAMA})"


def choose_cpu_engine(asked: str | None, repo: Path = REPO) -> tuple[str, str]:
    """``cpu_engine`` on this host."""
    return cpu_engine(asked, Built.here(repo))
