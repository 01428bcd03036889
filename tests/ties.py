"""Greedy tokens compared across compute paths, allowing only a flipped near tie.

The int8 shard kernels compute in bfloat16: a prompt chunk, a batch of rows and a lone decoded
row may round a logit differently. Where two runs' tokens part, the reference run's top two
logits at that point must lie within ``NEAR_TIE_ULPS`` bfloat16 steps of each other (equal within
rounding: a near tie flipped, not a bug). Which tokens tie depends on the CPU's kernels: on an
AVX2 host the tests' runs matched exactly; on an AVX-512 one a few flip at a gap of one step.
"""

from __future__ import annotations

import math

import torch

from services.worker.torch.shard import ShardModel

NEAR_TIE_ULPS = 2  #: bfloat16 steps (0.0625 at a logit of 8–16) within which the order may flip


def assert_same_or_near_tie(
    model: ShardModel, ids: list[int], got: list[int], want: list[int]
) -> None:
    """``got`` equals ``want`` (``model``'s greedy tokens after ``ids``), or parts from it at a
    near tie."""
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert at is not None, f"one run stopped early: {len(got)} tokens against {len(want)}"
    logits = model.forward(torch.tensor([ids + want[:at]]), model.new_cache())[0]
    top = torch.topk(logits, 2).values
    step = 2.0 ** (math.floor(math.log2(abs(float(top[0])))) - 7)  # bfloat16 keeps 8 bits
    gap = float(top[0] - top[1])
    assert gap <= NEAR_TIE_ULPS * step, f"token {at} differs at a logit gap of {gap}: no near tie"
