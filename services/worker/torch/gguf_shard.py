"""A torch shard's tensors read straight from a GGUF file (whole, or the sparse copy of a layer
range that ``libs/weights/layer_ranges.py`` fetched): only the shard's own tensors are touched.

Tensors are dequantised to float32 with the ``gguf`` package (the same routine transformers'
GGUF loader uses) and named as ``shard._read`` names them. llama.cpp's converter stores the
query and key matrices of a llama model with their rows permuted for its rotary embedding;
they are permuted back here, as transformers does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

#: A layer tensor's GGUF name (after ``blk.N.``) and the Hugging Face name ``shard`` reads.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
OTHER_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_config(path: Path) -> PretrainedConfig:
    """The model's configuration from the GGUF's header (no tensor is read)."""
    config: PretrainedConfig = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return config


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (None: one the torch shard does not use)."""
    if name.startswith("blk."):
        _, index, kind, suffix = name.split(".", 3)
        target = LAYER_NAMES.get(kind)
        return f"model.layers.{index}.{target}.{suffix}" if target else None
    return OTHER_NAMES.get(name)


def read_tensors(path: Path, config: PretrainedConfig, targets: Any) -> dict[str, torch.Tensor]:
    """The tensors ``targets(hf_name)`` maps to shard names (``shard._wanted``), float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        wanted = targets(name) if name else []
        if not wanted:
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])
        if ".attn_q." in tensor.name:
            values = _unpermute(values, heads)
        elif ".attn_k." in tensor.name:
            values = _unpermute(values, kv_heads)
        for target in wanted:
            state[target] = torch.from_numpy(np.array(values, dtype=np.float32))
    return state


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a query or key matrix (``convert_hf_to_gguf``'s permute)."""
    dim = weights.shape[0] // heads // 2
    grouped = weights.reshape(heads, dim, 2, *weights.shape[1:])
    return grouped.swapaxes(2, 1).reshape(weights.shape)
