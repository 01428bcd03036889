"""The shard model itself: float32 reproduces the reference implementation, and the bytes the
placement counts for a layer range are the bytes a loaded shard holds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from libs.core.catalogue import card_spec
from libs.models.chat import encode_chat
from libs.models.shipped import prepare, shipped_card
from services.worker.torch.shard import DEFAULT_PRECISION, ShardModel, greedy, shard_bytes


def test_float32_shards_give_the_reference_models_greedy_tokens() -> None:
    folder = prepare()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = encode_chat(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    expected = [t for t in out[0, len(ids) :].tolist() if t != tokenizer.eos_token_id]
    ours = greedy(ShardModel(folder, 0, 30, "float32"), ids, 16, {tokenizer.eos_token_id})
    assert ours == expected


@pytest.mark.parametrize("start,end", [(0, 30), (0, 10), (10, 20), (20, 30)])
def test_the_placements_bytes_per_layer_match_a_loaded_shard(start: int, end: int) -> None:
    folder = prepare()
    loaded = ShardModel(folder, start, end)
    assert loaded.precision == DEFAULT_PRECISION
    assert shard_bytes(folder, start, end) == loaded.parameter_bytes
    spec = card_spec(shipped_card(), "ring", 1)  # int8, as the CPU worker holds it
    planned = spec.shard_gb(end - start, start == 0, end == 30, 0) - spec.runtime_overhead_gb
    assert planned * 1e9 == pytest.approx(loaded.parameter_bytes, rel=0.10)


def test_lower_precisions_hold_fewer_bytes() -> None:
    folder = prepare()
    sizes = {p: shard_bytes(folder, 0, 30, p) for p in ("float32", "bfloat16", "int8")}
    assert sizes["int8"] < 0.3 * sizes["float32"] and sizes["bfloat16"] == pytest.approx(
        sizes["float32"] / 2, rel=0.01
    )
    assert ShardModel(folder, 5, 7, "bfloat16").parameter_bytes == shard_bytes(
        folder, 5, 7, "bfloat16"
    )
