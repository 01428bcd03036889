"""One shard of a Llama-family model: a contiguous range of its layers, run on a batch of requests.

The first shard owns the token embeddings, the last the final norm and the LM head; a shard that
is both runs the whole model. Only the shard's own tensors are read from the safetensors file, so
a shard of a big model fits where the whole would not.

A step runs every request active on the shard in one forward (continuous batching): the rows of
all requests are stacked, so each weight is read once per step, not once per request. A request
contributes a ``Segment`` — its slot in the ``KVCache`` and the rows it adds there (a prompt chunk,
or one decoded token). Attention of the one-row segments runs as one batched call over the cache's
slots; a prompt chunk attends on its own, causally.

Weights are held in one of ``PRECISIONS``: ``int8`` (weight-only, one scale per output channel,
PyTorch's CPU int8 kernel; the default: a quarter of float32's bytes and, measured here, faster),
``bfloat16`` or ``float32``. ``shard_bytes`` counts a layer range's bytes in a precision from the
file's header without loading it, and equals what a loaded shard holds.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from libs.contracts.base import Precision
from libs.models.shipped import WEIGHTS
from libs.runtime.settings import hub_offline
from services.worker.torch.kernels import KVCache, Linear, Segment, StepPlan, nbytes, rms, rope

LAYER_PREFIX = "model.layers."
PRECISIONS: tuple[str, ...] = get_args(Precision)
DEFAULT_PRECISION = "int8"
_LAYER_LINEARS = {  # the fused matrices of a layer and the stored tensors they stack
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


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
    def __init__(
        self, folder: Path, start: int, end: int, precision: str = DEFAULT_PRECISION
    ) -> None:
        hub_offline()
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        config = _config(folder)
        total = int(config.num_hidden_layers)
        if not 0 <= start < end <= total:
            raise ValueError(f"layer range [{start}, {end}) is not within the model's {total}")
        self.spec = ShardSpec(start, end, total)
        self.config = config
        self.precision = precision
        self.hidden_size = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.context = int(config.max_position_embeddings)
        self.inv_freq = 1.0 / _rope_theta(config) ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        )
        tensors = _read(folder, self.spec, config)
        self.layers = [_layer(tensors, index, precision) for index in range(end - start)]
        self.table = Linear(tensors["embed"], precision) if "embed" in tensors else None
        self.head = Linear(tensors["head"], precision) if "head" in tensors else None
        if self.table is None and self.spec.first:
            self.table = self.head
        self.norm = tensors.get("norm")
        self.parameter_bytes = _held_bytes(self)
        # Floating-point work per token: a multiply and an add per weight of the layers (the
        # embedding is a lookup), and of the head for each row it scores on the last shard.
        self.flops_per_token = 2 * sum(
            int(lin.weight.shape[0] * lin.weight.shape[1])
            for layer in self.layers
            for lin in layer.values()
            if isinstance(lin, Linear)
        )
        self.head_flops = 2 * int(self.head.weight.numel()) if self.head is not None else 0
        #: Floating-point operations run so far (read by the worker to measure its speed).
        self.flops = 0

    def new_cache(self, slots: int = 1) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, slots)

    def forward(self, rows: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One request alone: token ids ``[1, T]`` (first shard) or hidden states
        ``[1, T, H]``; returns hidden states ``[1, T, H]``, or on the last shard the final
        row's logits ``[1, V]``."""
        length = rows.shape[1]
        flat = rows[0]
        out = self.step(flat, [Segment(0, cache.length, length)], cache)
        cache.length += length
        return out if self.spec.last else out.unsqueeze(0)

    @torch.inference_mode()
    def step(self, rows: torch.Tensor, segments: Sequence[Segment], cache: KVCache) -> torch.Tensor:
        """One batched step: ``rows`` are the segments' rows stacked in order — token ids
        ``[N]`` on the first shard, hidden states ``[N, H]`` on the others. Returns hidden
        states ``[N, H]``, or on the last shard the logits of each segment's final row
        ``[len(segments), V]``."""
        total = sum(s.length for s in segments)
        if rows.shape[0] != total:
            raise ValueError(f"{rows.shape[0]} rows for segments of {total}")
        for seg in segments:
            if seg.start + seg.length > self.context:
                raise ValueError(f"position {seg.start + seg.length} beyond the context")
            cache.reserve(seg.slot, seg.start + seg.length)
        self.flops += self.flops_per_token * total + self.head_flops * len(segments)
        x = self.table.rows(rows) if self.spec.first else rows.float()  # type: ignore[union-attr]
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
        plan = StepPlan(segments, cache.k[0].shape[0])
        for index, layer in enumerate(self.layers):
            x = self._layer(layer, x, cache.k[index], cache.v[index], cos, sin, plan)
        if not self.spec.last:
            return x
        ends = torch.tensor(plan.ends)
        final = rms(x[ends], self.norm, self.eps)  # type: ignore[arg-type]
        return self.head(final)  # type: ignore[misc]

    def _layer(
        self,
        layer: dict[str, Linear | torch.Tensor],
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        h = rms(x, layer["input_layernorm"], self.eps)  # type: ignore[arg-type]
        qkv = layer["qkv"](h)  # type: ignore[operator]
        q_end, k_end = self.heads * hd, (self.heads + self.kv_heads) * hd
        q = rope(qkv[:, :q_end].view(n, self.heads, hd), cos, sin)
        k = rope(qkv[:, q_end:k_end].view(n, self.kv_heads, hd), cos, sin)
        v = qkv[:, k_end:].view(n, self.kv_heads, hd)
        attended = torch.empty(n, self.heads, hd)
        if plan.single:  # one-row segments: write and attend for all of them at once
            at, slots, pos = plan.single_rows, plan.single_slots, plan.single_pos
            keys[slots, :, pos] = k[at]
            values[slots, :, pos] = v[at]
            span = plan.span
            query = torch.zeros(keys.shape[0], self.heads, 1, hd)
            query[slots] = q[at].unsqueeze(2)
            out = F.scaled_dot_product_attention(
                query,
                keys[:, :, :span],
                values[:, :, :span],
                attn_mask=plan.mask,
                enable_gqa=True,
            )
            attended[at] = out[slots, :, 0]
        for offset, seg, causal in plan.chunks:  # prompt chunks: each attends causally
            rows = slice(offset, offset + seg.length)
            end = seg.start + seg.length
            keys[seg.slot, :, seg.start : end] = k[rows].transpose(0, 1)
            values[seg.slot, :, seg.start : end] = v[rows].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys[seg.slot : seg.slot + 1, :, :end],
                values[seg.slot : seg.slot + 1, :, :end],
                attn_mask=causal,
                enable_gqa=True,
            )
            attended[rows] = out[0].transpose(0, 1)
        x = x + layer["o"](attended.reshape(n, self.heads * hd))  # type: ignore[operator]
        h = rms(x, layer["post_attention_layernorm"], self.eps)  # type: ignore[arg-type]
        gate, up = layer["gate_up"](h).chunk(2, dim=-1)  # type: ignore[operator]
        return x + layer["down"](F.silu(gate) * up)  # type: ignore[operator]


def _rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta)


def _held_bytes(model: ShardModel) -> int:
    linears = [lin for layer in model.layers for lin in layer.values() if isinstance(lin, Linear)]
    norms = [t for layer in model.layers for t in layer.values() if isinstance(t, torch.Tensor)]
    tables = {id(t): t for t in (model.table, model.head) if t is not None}.values()
    extra = [model.norm] if model.norm is not None else []
    held = sum(lin.nbytes for lin in (*linears, *tables))
    return held + sum(nbytes(t) for t in (*norms, *extra))


def _layer(tensors: dict[str, torch.Tensor], index: int, precision: str) -> dict:  # type: ignore[type-arg]
    prefix = f"{index}."
    layer: dict[str, Linear | torch.Tensor] = {
        name: tensors[prefix + name + ".weight"] for name in _LAYER_NORMS
    }
    for fused, parts in _LAYER_LINEARS.items():
        stacked = torch.cat([tensors[f"{prefix}{p}.weight"] for p in parts])
        layer[fused] = Linear(stacked, precision)
    return layer


def _wanted(spec: ShardSpec, tied: bool) -> Callable[[str], list[str]]:
    """Map a stored tensor name to the names it fills in this shard (none, one or two):
    ``<layer index within the shard>.<rest>``, ``embed``, ``head``, ``norm``."""

    def targets(name: str) -> list[str]:
        if name.startswith(LAYER_PREFIX):
            index_text, rest = name[len(LAYER_PREFIX) :].split(".", 1)
            index = int(index_text)
            return [f"{index - spec.start}.{rest}"] if spec.start <= index < spec.end else []
        if name == "model.embed_tokens.weight":
            if tied:  # one table serves both ends (a whole model holds it once)
                return ["head"] if spec.last else (["embed"] if spec.first else [])
            return ["embed"] if spec.first else []
        if name == "lm_head.weight":
            return ["head"] if spec.last else []
        if name == "model.norm.weight":
            return ["norm"] if spec.last else []
        return []

    return targets


def _config(folder: Path) -> PretrainedConfig:
    """The model's configuration: from a Hugging Face ``folder``, or from a GGUF file (whole,
    or the sparse copy of a layer range: ``libs/weights/layer_ranges.py``)."""
    if folder.suffix == ".gguf":
        from services.worker.torch.gguf_shard import gguf_config

        return gguf_config(folder)
    config: PretrainedConfig = AutoConfig.from_pretrained(folder)
    return config


def _read(folder: Path, spec: ShardSpec, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    wanted = _wanted(spec, bool(config.tie_word_embeddings))
    if folder.suffix == ".gguf":
        from services.worker.torch.gguf_shard import read_tensors

        return read_tensors(folder, config, wanted)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            for target in wanted(name):
                state[target] = f.get_tensor(name).float()
    return state


def shard_bytes(folder: Path, start: int, end: int, precision: str = DEFAULT_PRECISION) -> int:
    """Bytes of weights a shard holds in ``precision``, read from the file's header without
    loading tensors: a matrix's elements at the precision's width (plus, for int8, one
    bfloat16 scale per output row); norms stay float32."""
    config = AutoConfig.from_pretrained(folder)
    spec = ShardSpec(start, end, int(config.num_hidden_layers))
    wanted = _wanted(spec, bool(config.tie_word_embeddings))
    width = getattr(torch, precision).itemsize
    total = 0
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            for _ in wanted(name):
                shape = f.get_slice(name).get_shape()
                if len(shape) == 1:
                    total += 4 * shape[0]
                else:
                    total += width * shape[0] * shape[1]
                    total += 2 * shape[0] if precision == "int8" else 0
    return total


def greedy(
    model: ShardModel, ids: Sequence[int], max_tokens: int, stop: Container[int]
) -> list[int]:
    """Greedy tokens of one request alone on a whole model (the reference a pipeline must
    reproduce); ends before a stop token or after ``max_tokens``."""
    if not (model.spec.first and model.spec.last):
        raise ValueError("greedy decoding needs the whole model")
    cache, out = model.new_cache(), []
    logits = model.forward(torch.tensor([list(ids)]), cache)
    for _ in range(max_tokens):
        token = int(logits.argmax())
        if token in stop:
            break
        out.append(token)
        logits = model.forward(torch.tensor([[token]]), cache)
    return out
