"""The guard of the test-model factory (tests/made_models.py): every architecture in F16 and Q8_0
loads in llama.cpp's own server, tokenizes text as SmolLM2 does, and generates greedily — tokens
that follow the prompt, the same on a fresh server; so do the other types it writes and the
K-quants and i-quant llama.cpp's quantizer makes of them. Other tests' models rest on this."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from libs.models.gguf_info import read_card
from libs.models.shipped import gguf_path
from tests.made_models import (
    ARCHS,
    QUANTIZED_TYPES,
    TENSOR_TYPES,
    VOCAB,
    llama_binaries,
    llama_server,
    llama_server_tokens,
    make_gguf,
)

pytestmark = pytest.mark.skipif(
    not (llama_binaries() / ".installed").exists(),
    reason=f"no llama.cpp build in {llama_binaries()}: `make llama` builds it (`make test` does)",
)
PROMPTS = ("The capital of France is", "Write a story about a fox who finds a key.")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_ids() -> list[list[int]]:
    """How llama.cpp tokenizes the prompts with the shipped SmolLM2 file."""
    with llama_server(gguf_path()) as server:
        return [server.post("/tokenize", {"content": p})["tokens"] for p in PROMPTS]


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_loads_tokenizes_and_generates(
    tmp_path: Path, arch: str, tensor_type: str, smollm2_ids: list[list[int]]
) -> None:
    path = make_gguf(tmp_path / "m.gguf", arch, tensor_type, layers=2, tied=arch != "llama")
    with llama_server(path) as server:
        assert [server.post("/tokenize", {"content": p})["tokens"] for p in PROMPTS] == smollm2_ids
        answers = [server.completion(p, NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    for answer in answers:
        tokens = answer["tokens"]
        assert len(tokens) == NEW_TOKENS and all(0 <= t < VOCAB for t in tokens)
        assert answer["content"]
    # Random weights, yet no constant output: the tokens vary along a run and with the prompt.
    assert len(set(answers[0]["tokens"])) > 1
    assert answers[0]["tokens"] != answers[1]["tokens"]


@pytest.mark.parametrize("tensor_type", sorted(set(TENSOR_TYPES) - {"F16", "Q8_0"}))
def test_every_other_type_the_factory_writes_loads_and_generates(
    tmp_path: Path, tensor_type: str
) -> None:
    path = make_gguf(tmp_path / "m.gguf", "qwen2", tensor_type, layers=2)
    tokens = llama_server_tokens(path, PROMPTS[0], NEW_TOKENS)
    assert len(set(tokens)) > 1 and all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize(
    ("arch", "file_type"),
    [("llama", "Q4_K_M"), ("qwen2", "Q5_K_M"), ("phi3", "Q6_K"), ("gemma2", "IQ4_XS")],
)
def test_k_quants_and_an_i_quant_made_by_llama_quantize_load_and_generate(
    tmp_path: Path, arch: str, file_type: str
) -> None:
    started = time.monotonic()
    path = make_gguf(tmp_path / "m.gguf", arch, file_type, layers=4, tied=arch != "llama")
    print(f"{arch} {file_type}: made in {time.monotonic() - started:.1f} s")  # the F16, quantized
    assert set(QUANTIZED_TYPES[file_type]) <= set(read_card(path).tensor_types)
    with llama_server(path) as server:
        answers = [server.completion(p, NEW_TOKENS, ignore_eos=True)["tokens"] for p in PROMPTS]
    assert all(len(t) == NEW_TOKENS and all(0 <= i < VOCAB for i in t) for t in answers)
    assert len(set(answers[0])) > 1 and answers[0] != answers[1]


def test_the_reference_is_the_same_on_a_fresh_server(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", "qwen2", "Q8_0", layers=2)
    with llama_server(path) as server:
        first = server.tokens(PROMPTS[1], 16)
    assert llama_server_tokens(path, PROMPTS[1], 16) == first
    assert len(first) == 16  # no EOS from this model and prompt: the comparison covers 16
