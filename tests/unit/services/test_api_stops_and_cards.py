"""The API's details that need no process: which stop sequence ended a text
(llama.cpp's own fields, then Anthropic's ``stop_reason``), JSON output's limits, and a
model's card in Ollama's words."""

from __future__ import annotations

import json
import time

import pytest

from libs.contracts import Prompt, Sampling
from libs.contracts.models import ModelCard
from services.gateway.anthropic.serving import stop_of
from services.gateway.core.answers import MAX_TOKENS
from services.gateway.core.errors import ApiError
from services.gateway.ollama.cards import details, model_info, parameter_size, quantization
from services.gateway.openai.protocol import ChatCompletionRequest
from services.gateway.openai.serving import chat_ask
from services.worker.served.llama_prompts import request_body, stopping_word

CHAT = Prompt(kind="chat", body=json.dumps({"messages": [{"role": "user", "content": "hi"}]}))


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_llama_cpp_is_asked_which_stop_word_ended_the_text_only_when_there_are_some() -> None:
    asked = request_body(CHAT, Sampling(max_tokens=8, stop=("5",)))
    assert asked["verbose"] is True
    assert asked["response_fields"] == ["stop_type", "stopping_word"]
    assert "verbose" not in request_body(CHAT, Sampling(max_tokens=8))


@pytest.mark.parametrize(
    ("event", "word"),
    [
        ({"__verbose": {"stop_type": "word", "stopping_word": "5"}}, "5"),
        ({"__verbose": {"stop_type": "eos", "stopping_word": ""}}, None),
        ({"__verbose": {"stop_type": "limit", "stopping_word": ""}}, None),
        ({"choices": []}, None),
    ],
)
def test_the_stopping_word_is_read_from_llama_cpp_s_own_fields(
    event: dict[str, object], word: str | None
) -> None:
    assert stopping_word(event) == word


@pytest.mark.parametrize(
    ("finish", "sequence", "reason", "named"),
    [
        ("stop", "5", "stop_sequence", "5"),
        ("stop", None, "end_turn", None),
        ("length", None, "max_tokens", None),
        ("tool_calls", None, "tool_use", None),
    ],
)
def test_anthropic_s_stop_reason_names_the_stop_sequence(
    finish: str, sequence: str | None, reason: str, named: str | None
) -> None:
    assert stop_of(finish, sequence) == {"stop_reason": reason, "stop_sequence": named}


def test_json_output_has_the_context_s_room_and_no_stop_sequence_to_cut_it() -> None:
    json_object = {"type": "json_object"}
    unbounded = chat_ask(chat(response_format=json_object))
    assert unbounded.fit and unbounded.sampling.max_tokens == MAX_TOKENS
    bounded = chat_ask(chat(response_format=json_object, max_tokens=50))
    assert not bounded.fit and bounded.sampling.max_tokens == 50
    assert not chat_ask(chat()).fit  # a plain chat keeps its default limit
    with pytest.raises(ApiError) as cut:
        chat_ask(chat(response_format=json_object, stop=["}"]))
    assert cut.value.status == 400 and cut.value.param == "stop"


def card(**over: object) -> ModelCard:
    fields: dict[str, object] = {
        "name": "smollm2-135m-instruct",
        "source": "/models/SmolLM2-135M-Instruct-Q8_0.gguf",
        "origin_host": "here",
        "file_name": "SmolLM2-135M-Instruct-Q8_0.gguf",
        "sha256": "0" * 64,
        "size_bytes": 145_000_000,
        "architecture": "llama",
        "layers": 30,
        "layer_bytes": (1,) * 30,
        "layer_params": (1,) * 30,
        "embedding_bytes": 1,
        "embedding_params": 1,
        "output_bytes": 1,
        "output_params": 1,
        "tied": True,
        "kv_bytes_per_token": 1,
        "context_train": 8192,
        "tensor_types": ("F32", "Q8_0"),
        "params": 134_515_008,
        "stop_tokens": ("<|im_end|>",),
        "added_ts": time.time(),
        **over,
    }
    return ModelCard.model_validate(fields)


def test_a_model_s_card_in_ollama_s_words() -> None:
    assert parameter_size(134_515_008) == "134.52M"
    assert parameter_size(7_600_000_000) == "7.6B"
    assert quantization(card()) == "Q8_0"
    assert quantization(card(file_name="model.gguf", tensor_types=("F32", "F16"))) == "F16"
    shown = details(card())
    assert shown["family"] == "llama" and shown["parameter_size"] == "134.52M"
    info = model_info(card(), 2048)
    assert info["llama.context_length"] == 8192 and info["general.parameter_count"] == 134_515_008
