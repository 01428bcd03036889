"""Turning logits into tokens and tokens into text, one step at a time.

Sampling is reproducible: the random draw for token ``index`` of a request depends only on the
request's seed and ``index``, so a request re-run after a migration draws what it would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from libs.contracts import Sampling


def step_seed(seed: int | None, request_id: str, index: int) -> int:
    base = f"{seed}" if seed is not None else request_id
    digest = hashlib.blake2b(f"{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample(logits: torch.Tensor, sampling: Sampling, request_id: str, index: int) -> int:
    """One token from ``logits`` ``[1, V]``: greedy at temperature 0, else temperature + top-p."""
    row = logits[0].float()
    if sampling.temperature == 0.0:
        return int(torch.argmax(row))
    probs = torch.softmax(row / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    generator = torch.Generator().manual_seed(step_seed(sampling.seed, request_id, index))
    return int(torch.multinomial(probs, 1, generator=generator))


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class TextStream:
    """Incremental detokenisation with stop strings.

    ``push(token)`` returns the text that is now certain: it holds back an unfinished UTF-8
    sequence and any tail that could still become a stop string.
    """

    tokenizer: Decoder
    stops: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  #: all text decoded so far (stop string excluded once found)
    sent: int = 0  #: characters of ``text`` already returned
    stopped: bool = False
    stop_word: str | None = None  #: the stop string that ended the text, once one did
    _prefix: int = 0
    _read: int = 0

    def prime(self, ids: Sequence[int]) -> None:
        """Tokens already streamed before a re-run: their text counts as sent."""
        for token in ids:
            self.push(token)
        self.sent = len(self.text)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read], True)
        new_text = self.tokenizer.decode(self.ids[self._prefix :], True)
        if new_text.endswith("\ufffd"):
            return ""  # the middle of a multi-byte character
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        for stop in self.stops:
            at = self.text.find(stop)
            if at != -1:  # the last one cut is the earliest in the text
                self.text, self.stopped, self.stop_word = self.text[:at], True, stop
        hold = 0 if self.stopped else _partial_stop(self.text, self.stops)
        ready = self.text[self.sent : len(self.text) - hold]
        self.sent += len(ready)
        return ready

    def flush(self) -> str:
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that begins some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-size:]):
                longest = size
                break
    return longest
