"""One shard of a decoder-only model: a contiguous range of its layers, loaded alone.

The first shard owns the token embeddings, the last the final norm and the LM head; a shard
that is both runs the whole model. Only the shard's own tensors are read from the safetensors
file, so a shard of a big model fits where the whole would not. Each request keeps its own KV
cache (``new_cache()``); positions come from the cache's length, so a shard needs nothing but
the rows it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig

from libs.models.store import WEIGHTS
from libs.runtime.settings import hub_offline

LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class ShardSpec:
    start: int
    end: int  #: exclusive
    total: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.total


class ShardModel:
    def __init__(self, folder: Path, start: int, end: int) -> None:
        hub_offline()
        config = AutoConfig.from_pretrained(folder)
        total = int(config.num_hidden_layers)
        if not 0 <= start < end <= total:
            raise ValueError(f"layer range [{start}, {end}) is not within the model's {total}")
        self.spec = ShardSpec(start, end, total)
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.model: Any = _build(config, self.spec, folder / WEIGHTS)
        self.parameter_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Floating-point work per token: a multiply and an add per weight of the layers (the
        # embedding is a lookup), and of the head for the one row it scores on the last shard.
        layers = sum(p.numel() for p in self.model.model.layers.parameters())
        self.flops_per_token = 2 * layers
        self.head_flops = 2 * self.model.lm_head.weight.numel() if self.spec.last else 0
        #: Floating-point operations run so far (read by the worker to measure its speed).
        self.flops = 0

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Token ids ``[1, T]`` (first shard) or hidden states ``[1, T, H]`` (the others).

        Returns hidden states ``[1, T, H]``, or on the last shard the logits of the final row
        ``[1, V]``.
        """
        inner = self.model.model
        self.flops += self.flops_per_token * rows.shape[1] + self.head_flops
        if self.spec.first:
            out = inner(input_ids=rows, past_key_values=cache, use_cache=True)
        else:
            out = inner(inputs_embeds=rows, past_key_values=cache, use_cache=True)
        hidden: torch.Tensor = out.last_hidden_state
        if not self.spec.last:
            return hidden
        logits: torch.Tensor = self.model.lm_head(hidden[:, -1, :])
        return logits


def _build(config: PretrainedConfig, spec: ShardSpec, weights: Path) -> Any:
    sub = config.__class__.from_dict(config.to_dict())
    sub.num_hidden_layers = spec.end - spec.start
    tied = bool(config.tie_word_embeddings)
    sub.tie_word_embeddings = False
    torch.manual_seed(0)  # weights are all overwritten below; keep construction deterministic
    model: Any = AutoModelForCausalLM.from_config(sub, dtype=torch.float32)  # type: ignore[no-untyped-call]
    if not spec.first:  # this shard never embeds tokens: a one-row table instead of 100 MB
        model.model.embed_tokens = nn.Embedding(1, int(config.hidden_size))
    if not spec.last:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()
    wanted = _wanted(spec, tied)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            for target in wanted(name):
                state[target] = f.get_tensor(name)
    missing, unexpected = model.load_state_dict(state, strict=False)
    needed = [m for m in missing if spec.first or not m.startswith("model.embed_tokens")]
    if needed or unexpected:
        raise ValueError(f"shard weights do not fit: missing {needed}, unexpected {unexpected}")
    model.eval()
    return model


def _wanted(spec: ShardSpec, tied: bool):  # type: ignore[no-untyped-def]
    """Map a stored tensor name to the names it fills in this shard (none, one or two)."""

    def targets(name: str) -> list[str]:
        if name.startswith(LAYER_PREFIX):
            index_text, rest = name[len(LAYER_PREFIX) :].split(".", 1)
            index = int(index_text)
            if spec.start <= index < spec.end:
                return [f"{LAYER_PREFIX}{index - spec.start}.{rest}"]
            return []
        if name == "model.embed_tokens.weight":
            out = ["model.embed_tokens.weight"] if spec.first else []
            if tied and spec.last:
                out.append("lm_head.weight")
            return out
        if name in ("model.norm.weight", "lm_head.weight"):
            return [name] if spec.last else []
        return []

    return targets


def shard_bytes(folder: Path, start: int, end: int) -> int:
    """Bytes of weights a shard holds, read from the file's header without loading tensors."""
    config = AutoConfig.from_pretrained(folder)
    spec = ShardSpec(start, end, int(config.num_hidden_layers))
    wanted = _wanted(spec, bool(config.tie_word_embeddings))
    total = 0
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            count = len(wanted(name))
            if count:
                shape = f.get_slice(name).get_shape()
                size = 4
                for dim in shape:
                    size *= dim
                total += count * size
    return total
