"""The pieces a shard's batched step is made of: weights in a precision, the slot KV cache,
the plan of a step's rows, and the row-wise operations (RMS norm, rotary positions)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Segment:
    """A request's rows in one step: they go to ``slot`` of the cache at ``start`` onwards."""

    slot: int
    start: int
    length: int


class Linear:
    """``x @ weight.T`` with the weight held in a precision (activations stay float32)."""

    def __init__(self, weight: torch.Tensor, precision: str) -> None:
        self.precision = precision
        if precision == "int8":
            scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            self.weight = torch.round(weight / scale[:, None]).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)
        else:
            self.weight = weight.to(getattr(torch, precision)).contiguous()
            self.scale = torch.empty(0)

    @property
    def nbytes(self) -> int:
        return nbytes(self.weight) + nbytes(self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision == "int8":
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale)
            return out.float()
        if self.precision == "float32":
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, as float32 (an embedding lookup in a tied table)."""
        picked = self.weight[ids].float()
        return picked * self.scale[ids].float()[:, None] if self.precision == "int8" else picked


class KVCache:
    """Keys and values of up to ``slots`` requests for a shard's layers, grown on demand."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int = 1) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.capacity_slots = slots
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0  #: rows held in slot 0 (what ``ShardModel.forward`` uses)
        self._alloc(1, 64)

    def _alloc(self, slots: int, rows: int) -> None:
        old_k, old_v = self.k, self.v
        shape = (slots, self.kv_heads, rows, self.head_dim)
        self.k = [torch.zeros(shape) for _ in range(self.layers)]
        self.v = [torch.zeros(shape) for _ in range(self.layers)]
        for new, old in zip((*self.k, *self.v), (*old_k, *old_v), strict=False):
            new[: old.shape[0], :, : old.shape[2]] = old

    def reserve(self, slot: int, rows: int) -> None:
        """Room for ``rows`` rows in ``slot`` (doubling what is short)."""
        if slot >= self.capacity_slots:
            raise ValueError(f"slot {slot} of a cache with {self.capacity_slots}")
        have_slots, have_rows = self.k[0].shape[0], self.k[0].shape[2]
        if slot < have_slots and rows <= have_rows:
            return
        slots = min(self.capacity_slots, max(have_slots, 1 << slot.bit_length()))
        self._alloc(max(slots, slot + 1), max(have_rows, 1 << (rows - 1).bit_length()))

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for t in (*self.k, *self.v))


class StepPlan:
    """Where each segment's rows sit in a step, and the attention masks every layer of the
    step shares: one-row segments attend in one batched call, chunks one by one."""

    def __init__(self, segments: Sequence[Segment], slots: int) -> None:
        self.chunks: list[tuple[int, Segment, torch.Tensor]] = []
        singles: list[tuple[int, Segment]] = []
        self.ends: list[int] = []
        per_slot = collections.Counter(seg.slot for seg in segments)
        offset = 0
        for seg in segments:  # a slot with several segments (prompt chunks) goes in order
            if seg.length == 1 and per_slot[seg.slot] == 1:
                singles.append((offset, seg))
            else:
                end = seg.start + seg.length
                causal = torch.arange(end)[None, :] <= torch.arange(seg.start, end)[:, None]
                self.chunks.append((offset, seg, causal))
            offset += seg.length
            self.ends.append(offset - 1)
        self.single = bool(singles)
        self.single_rows = torch.tensor([o for o, _ in singles], dtype=torch.long)
        self.single_slots = torch.tensor([s.slot for _, s in singles], dtype=torch.long)
        self.single_pos = torch.tensor([s.start for _, s in singles], dtype=torch.long)
        #: Positions the one-row segments attend over, and which of them each slot may see
        #: (slots not in this step see position 0 only: their rows are discarded).
        self.span = int(self.single_pos.max()) + 1 if singles else 0
        reach = torch.zeros(slots, dtype=torch.long)
        reach[self.single_slots] = self.single_pos
        self.mask = (torch.arange(self.span)[None, :] <= reach[:, None])[:, None, None, :]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
