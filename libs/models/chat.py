"""Chat messages to prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant's turn, ready to generate from."""
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
    )
    ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    return [int(i) for i in ids]
