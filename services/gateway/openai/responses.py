"""OpenAI's answer shapes: completions, chat completions, their stream chunks, models; and an
answer's pieces (tool calls, log-probabilities) in those shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from libs.contracts import TokenLogprob, ToolCall
from services.gateway.openai.protocol import FunctionCall


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tessera"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: list[TokenLogprobOut] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TextLogprobs(BaseModel):
    """The legacy completions' shape: parallel lists per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def text_chunk(
    rid: str,
    model: str,
    created: int,
    text: str,
    finish: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def tool_call_delta(
    calls: tuple[ToolCall, ...] | list[ToolCall], first: int
) -> list[dict[str, Any]]:
    """Tool calls as OpenAI's stream sends them (each whole, numbered from ``first``)."""
    return [
        {
            "index": first + i,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]


def chat_logprobs(logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.bytes) if lp.bytes is not None else None,
                "top_logprobs": [
                    {
                        "token": t.token,
                        "logprob": t.logprob,
                        "bytes": list(t.bytes) if t.bytes is not None else None,
                    }
                    for t in lp.top
                ],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def text_logprobs(
    logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """The legacy completions' log-probabilities: parallel lists per token."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(lp.token)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
