"""A model's card read from its GGUF: sizes that add up to the file, for the shipped SmolLM2 and
for generated models of other architectures and tensor types; and files that are not GGUFs, cut
short or not the file their publisher hashed, refused naming the cause."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest

from libs.contracts import ModelCard
from libs.models.gguf_info import ModelFileError, read_card
from libs.models.shipped import MODEL_NAME, gguf_path, shipped_card
from tests.made_models import QUANTIZED_TYPES, llama_binaries, make_gguf

#: The header, metadata (SmolLM2's tokenizer: ~1.8 MB) and tensor alignment: what a file
#: holds besides its tensors.
HEADER_MAX = 2_000_000


def assert_adds_up(card: ModelCard) -> None:
    assert len(card.layer_bytes) == len(card.layer_params) == card.layers > 0
    assert all(b > 0 for b in card.layer_bytes)
    assert 0 < card.size_bytes - card.weights_bytes < HEADER_MAX, card.size_bytes


def test_the_shipped_model_reads_as_its_file_says() -> None:
    card = shipped_card()
    assert (card.name, card.architecture, card.layers) == (MODEL_NAME, "llama", 30)
    assert_adds_up(card)
    assert set(card.layer_bytes) == {2_216_448}  # Q4_1 matrices and F32 norms, every layer
    assert card.embedding_bytes == 30_081_024  # token_embd, Q8_0
    assert card.tied and card.output_bytes == 2304  # the output norm only (F32 × 576)
    assert card.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2  # 3 KV heads of 64, K and V, f16
    assert card.context_train == 8192
    assert set(card.tensor_types) == {"F32", "Q4_1", "Q8_0"}
    # the layers' weights by type (the norms' F32: 2 × 576 a layer), the output's type
    assert card.layer_type_params == {"F32": 30 * 2 * 576, "Q4_1": sum(card.layer_params) - 34_560}
    assert card.output_type == "Q8_0"  # tied: the token embeddings'
    assert card.chat_template and "<|im_start|>" in card.chat_template
    assert card.eos_token == "<|im_end|>" and card.stop_tokens == ("<|im_end|>",)
    assert card.tokenizer_model == "gpt2"
    assert card.sha256 == hashlib.sha256(gguf_path().read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "arch,tensor_type,tied",
    [
        ("qwen2", "F16", False),
        ("gemma2", "Q8_0", True),
        ("phi3", "Q8_0", False),
        ("llama", "Q4_0", True),
    ],
)
def test_generated_models_of_other_architectures_add_up(
    tmp_path: Path, arch: str, tensor_type: str, tied: bool
) -> None:
    path = make_gguf(
        tmp_path / f"{arch}.gguf", arch, tensor_type, layers=3, hidden=128, heads=4, kv_heads=2,
        ffn=256, tied=tied,
    )  # fmt: skip
    card = read_card(path, now=1.0)
    assert (card.architecture, card.layers, card.tied) == (arch, 3, tied)
    assert card.name == arch and card.source == str(path.resolve())
    assert_adds_up(card)
    assert len(set(card.layer_bytes)) == 1  # the same tensors in every layer
    assert tensor_type in card.tensor_types
    assert set(card.layer_type_params) == {"F32", tensor_type} and card.output_type == tensor_type
    assert card.kv_bytes_per_token == 3 * 2 * 32 * 2 * 2  # 2 KV heads of 128 / 4, K and V, f16
    assert card.output_bytes > (0 if tied else card.embedding_bytes // 2)


@pytest.mark.skipif(
    not (llama_binaries() / "llama-quantize").exists(), reason="no llama-quantize: `make llama`"
)
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "IQ4_XS"])  # Q6_K: in both _M
def test_k_quant_and_i_quant_files_are_counted_to_the_byte(tmp_path: Path, file_type: str) -> None:
    """Made by llama.cpp's own quantizer: each tensor's bytes as the card counts them fill the
    file exactly up to the next tensor (only the alignment's padding between), and to its end."""
    path = make_gguf(tmp_path / "m.gguf", "qwen2", file_type, layers=8, hidden=256, ffn=512)
    card = read_card(path)
    assert_adds_up(card)
    assert set(QUANTIZED_TYPES[file_type]) <= set(card.tensor_types)
    reader = gguf.GGUFReader(path)
    align = int(reader.alignment)
    tensors = sorted(reader.tensors, key=lambda t: t.data_offset)
    ends = [t.data_offset for t in tensors[1:]] + [path.stat().st_size]
    counted = {t.name: t.n_bytes for t in tensors}  # the type tables' count, as the card's
    for tensor, end in zip(tensors, ends, strict=True):
        assert -(-counted[tensor.name] // align) * align == end - tensor.data_offset, tensor.name
    for index, layer in enumerate(card.layer_bytes):
        assert layer == sum(b for n, b in counted.items() if n.startswith(f"blk.{index}."))
    assert card.weights_bytes == sum(counted.values())
    assert sum(card.layer_type_params.values()) == sum(card.layer_params)
    if file_type.endswith("_M"):  # a mixed quantization: some layers wider (Q6_K attn_v, ffn)
        assert len(set(card.layer_bytes)) > 1
        assert set(QUANTIZED_TYPES[file_type]) <= set(card.layer_type_params)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am a text file\n" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_card(text)
    with pytest.raises(ModelFileError, match="no such file"):
        read_card(tmp_path / "missing.gguf")


def test_a_file_cut_short_is_refused(tmp_path: Path) -> None:
    whole = make_gguf(tmp_path / "whole.gguf", "llama", "F16", layers=2, hidden=64, ffn=128)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])  # the last tensor's end is missing
    with pytest.raises(ModelFileError, match="truncated"):
        read_card(cut)
    cut.write_bytes(data[:100_000])  # cut inside the metadata
    with pytest.raises(ModelFileError, match=r"cut\.gguf: its GGUF header cannot be read"):
        read_card(cut)


def test_a_file_that_is_not_the_one_its_publisher_hashed_is_refused(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", "qwen2", "F16", layers=2, hidden=64, ffn=128)
    published = read_card(path).sha256
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one weight's byte flipped: the header still reads
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="corrupt"):
        read_card(path, expect_sha256=published)
