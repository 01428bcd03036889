"""Sampling and incremental detokenisation with SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from libs.contracts import Sampling
from libs.harness.workers import even_split
from libs.models.shipped import prepare
from services.worker.torch.decoding import TextStream, sample


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(prepare())


def test_streamed_text_equals_decoding_all_tokens_at_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Héllo wörld — naïve café 日本語 emoji 🙂 done."
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_a_stop_string_is_cut_and_never_half_sent(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("The answer is 42. END of story")["input_ids"]
    stream = TextStream(tokenizer, stops=("END",))
    sent = ""
    for token in ids:
        sent += stream.push(token)
        if stream.stopped:
            break
    sent += stream.flush()
    assert stream.stopped and sent == "The answer is 42. "


def test_the_stop_string_that_ended_the_text_is_named(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Anthropic's ``stop_sequence`` on the torch engine: the earliest stop in the text."""
    stream = TextStream(tokenizer, stops=("story", "42"))
    for token in tokenizer("The answer is 42. END of story")["input_ids"]:
        stream.push(token)
        if stream.stopped:  # the engine ends the request here
            break
    assert stream.stopped and stream.stop_word == "42"
    assert TextStream(tokenizer, stops=("nowhere",)).stop_word is None


def test_primed_tokens_count_as_sent(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("one two three four")["input_ids"]
    stream = TextStream(tokenizer)
    stream.prime(ids[:2])
    rest = "".join(stream.push(i) for i in ids[2:]) + stream.flush()
    assert tokenizer.decode(ids[:2]) + rest == "one two three four"


def test_sampling_is_greedy_at_zero_and_reproducible_per_index() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    assert sample(logits, Sampling(temperature=0.0), "r", 0) == int(logits.argmax())
    hot = Sampling(temperature=1.5, top_p=0.9, seed=3)
    draws = [sample(logits, hot, "r", i) for i in range(20)]
    assert draws == [sample(logits, hot, "other", i) for i in range(20)]  # the seed decides
    assert len(set(draws)) > 1
    narrow = Sampling(temperature=1.0, top_p=1e-6)
    assert {sample(logits, narrow, "r", i) for i in range(10)} == {int(logits.argmax())}


def test_even_split_covers_every_layer_once() -> None:
    assert even_split(30, 1) == [(0, 30)]
    assert even_split(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    with pytest.raises(ValueError):
        even_split(3, 4)
