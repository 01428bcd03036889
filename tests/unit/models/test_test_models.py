"""The test-model factory (tests/made_models.py) writes what it claims: each architecture's tensors
and keys, weights of the type asked with values that stay small and finite, SmolLM2's tokenizer,
and a file of about the size asked. Loading in llama.cpp: tests/integration/test_test_models.py.

Files are read back with ``gguf.GGUFReader``, which takes ~3 s on any file with SmolLM2's
49,152-token vocabulary: each file is written and read once per module."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.made_models import ARCHS, VOCAB, Dims, make_gguf, smollm2_tokenizer, tensor_specs

#: Every architecture, and every type at least once.
CASES = (
    ("llama", "F16"),
    ("qwen2", "Q8_0"),
    ("gemma2", "Q4_0"),
    ("phi3", "BF16"),
    ("llama", "Q5_1"),
    ("phi3", "Q8_0"),
)


@pytest.fixture(scope="module")
def readers(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], gguf.GGUFReader]:
    folder = tmp_path_factory.mktemp("models")
    return {
        (arch, kind): gguf.GGUFReader(
            make_gguf(folder / f"{arch}-{kind}.gguf", arch, kind, layers=2)
        )
        for arch, kind in CASES
    }


def field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.parametrize(("arch", "tensor_type"), CASES)
def test_each_architecture_and_type_is_written_as_asked(
    readers: dict[tuple[str, str], gguf.GGUFReader], arch: str, tensor_type: str
) -> None:
    reader = readers[arch, tensor_type]
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.block_count") == 2
    assert field(reader, f"{arch}.embedding_length") == 256
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["token_embd.weight"].shape.tolist() == [256, VOCAB]
    assert "output.weight" not in tensors  # tied by default
    assert {n.split(".")[1] for n in tensors if n.startswith("blk.")} == {"0", "1"}
    specs = {s.name: s for s in tensor_specs(arch, tensor_type, Dims(2, 256, 4, 2, 512), True)}
    assert set(tensors) == set(specs)
    for name, tensor in tensors.items():
        is_vector = "norm" in name or name.endswith(".bias")
        assert tensor.tensor_type.name == ("F32" if is_vector else tensor_type), name
        values = gguf.quants.dequantize(tensor.data[:512], tensor.tensor_type)
        assert np.isfinite(values).all(), name
        if "norm" in name:
            assert (values == 1).all(), name
            continue
        std = specs[name].std
        assert 0.8 * std < float(values.std()) < 1.2 * std, name
        # Five standard errors: a quant range off centre (Q4_0's -8..7) is 0.11 std away.
        assert abs(float(values.mean())) < 5 * std / values.size**0.5, name


def test_architecture_specific_tensors(readers: dict[tuple[str, str], gguf.GGUFReader]) -> None:
    assert {arch for arch, _ in CASES} == set(ARCHS)
    names = {arch: {t.name for t in readers[arch, kind].tensors} for arch, kind in CASES}
    assert "blk.0.attn_qkv.weight" in names["phi3"] and "blk.0.attn_q.weight" not in names["phi3"]
    assert "blk.0.ffn_gate.weight" not in names["phi3"]
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names["gemma2"]
    biases = {f"blk.{i}.attn_{x}.bias" for i in range(2) for x in "qkv"}
    assert biases <= names["qwen2"]
    assert names["llama"] == names["qwen2"] - biases
    keys = readers["gemma2", "Q4_0"].fields
    assert field(readers["gemma2", "Q4_0"], "gemma2.final_logit_softcapping") == 30.0
    assert "gemma2.attention.sliding_window" in keys


def test_the_tokenizer_and_template_are_smollm2s(
    readers: dict[tuple[str, str], gguf.GGUFReader],
) -> None:
    reader = readers["qwen2", "Q8_0"]
    shipped = {key: value for key, value, _, _ in smollm2_tokenizer()}
    assert len(shipped["tokenizer.ggml.tokens"]) == VOCAB
    assert {k for k in reader.fields if k.startswith("tokenizer.")} == set(shipped)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert field(reader, key) == shipped[key]
    assert field(reader, "tokenizer.ggml.tokens") == shipped["tokenizer.ggml.tokens"]
    assert field(reader, "tokenizer.ggml.merges") == shipped["tokenizer.ggml.merges"]


def test_untied_output_is_its_own_tensor_and_gemma2_refuses_it(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(make_gguf(tmp_path / "m.gguf", "llama", "Q8_0", layers=1, tied=False))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    assert output.shape.tolist() == [256, VOCAB] and output.tensor_type.name == "Q8_0"
    with pytest.raises(ValueError, match="gemma2"):
        make_gguf(tmp_path / "g.gguf", "gemma2", tied=False)


@pytest.mark.parametrize(("tensor_type", "target"), [("Q8_0", 60_000_000), ("F16", 40_000_000)])
def test_target_bytes_gives_a_file_of_about_that_size(
    tmp_path: Path, tensor_type: str, target: int
) -> None:
    path = make_gguf(tmp_path / "m.gguf", "llama", tensor_type, layers=8, target_bytes=target)
    assert abs(path.stat().st_size - target) < 0.02 * target
    # The header's first tensor count: 8 layers of 9 tensors, the embedding and the final norm.
    assert int.from_bytes(path.read_bytes()[8:16], "little") == 8 * 9 + 2


def test_the_seed_decides_the_weights(tmp_path: Path) -> None:
    first = make_gguf(tmp_path / "a.gguf", "phi3", "Q4_0", layers=1, seed=1).read_bytes()
    again = make_gguf(tmp_path / "b.gguf", "phi3", "Q4_0", layers=1, seed=1).read_bytes()
    other = make_gguf(tmp_path / "c.gguf", "phi3", "Q4_0", layers=1, seed=2).read_bytes()
    assert first == again and first != other and len(first) == len(other)


def test_unknown_architecture_and_type_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mamba"):
        make_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(ValueError, match="Q4_K"):
        make_gguf(tmp_path / "m.gguf", "llama", "Q4_K")


def test_a_base_model_has_no_template_and_k_quants_need_256_wide_blocks(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "base.gguf", "qwen2", "Q8_0", layers=1, chat_template=False)
    fields = gguf.GGUFReader(path).fields
    assert "tokenizer.chat_template" not in fields and "tokenizer.ggml.tokens" in fields
    with pytest.raises(ValueError, match="by 256"):
        make_gguf(tmp_path / "k.gguf", "qwen2", "Q4_K_M", hidden=128)
    assert not list(tmp_path.glob("k.*"))  # nothing written
