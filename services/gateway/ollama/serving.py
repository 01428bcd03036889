"""Ollama's requests in OpenAI's words, and the answer's pieces in Ollama's.

``/api/generate`` applies the model's chat template to its prompt (a user turn after the
optional ``system``) unless ``raw`` is set, as Ollama does. ``options`` the engines cannot honour
are refused by name.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from libs.contracts import TokenChunk
from services.gateway.core.answers import MAX_TOKENS, Ask, Choice
from services.gateway.core.errors import ApiError
from services.gateway.ollama.protocol import BaseBody, ChatBody, GenerateBody, model_name
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.openai.responses import chat_logprobs
from services.gateway.openai.serving import chat_ask, text_ask

#: Ollama's options and the OpenAI field each becomes; the rest are refused by name.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
#: Options that size the model's load, not the answer: the deployment fixed them.
LOAD = {"num_ctx", "num_batch", "num_gpu", "num_thread", "main_gpu", "use_mmap", "num_keep"}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def common_fields(body: BaseBody) -> dict[str, Any]:
    """The OpenAI fields of Ollama's ``options`` and ``format`` (400 naming what cannot be)."""
    for name in ("think",):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported here", param=name)
    fields: dict[str, Any] = {"model": model_name(body.model), "temperature": 0.8}
    for key, value in (body.options or {}).items():
        if key in OPTIONS:
            fields[OPTIONS[key]] = value
        elif key not in LOAD:
            raise ApiError(400, f"options.{key} is not supported here", param=f"options.{key}")
    if body.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    if fields.get("max_tokens") in (None, -1, -2):
        fields["max_tokens"] = MAX_TOKENS
    if not isinstance(fields["max_tokens"], int) or fields["max_tokens"] < 1:
        raise ApiError(400, "options.num_predict: a positive integer, or -1", param="options")
    fields["max_tokens"] = min(fields["max_tokens"], MAX_TOKENS)
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict) and body.format:
        schema = {"name": "answer", "schema": body.format}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return fields


def validated(
    model: type[ChatCompletionRequest] | type[CompletionRequest], fields: dict[str, Any]
) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{where}: {first.get('msg')}", param=where or None) from None


def chat_request(body: ChatBody) -> ChatCompletionRequest:
    fields = common_fields(body)
    messages: list[dict[str, Any]] = []
    calls_seen = 0
    for i, message in enumerate(body.messages):
        if message.images:
            raise ApiError(400, "images are not supported here", param=f"messages[{i}].images")
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": f"call_{calls_seen + k}",
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.dumps(c.function.arguments),
                    },
                }
                for k, c in enumerate(message.tool_calls)
            ]
            calls_seen += len(message.tool_calls)
        if message.role == "tool":
            out["tool_call_id"] = f"call_{max(calls_seen - 1, 0)}"
        messages.append(out)
    if not messages:
        raise ApiError(400, "messages: at least one message is needed", param="messages")
    fields["messages"] = messages
    if body.tools:
        fields["tools"] = body.tools
    request: ChatCompletionRequest = validated(ChatCompletionRequest, fields)
    return request


def generate_ask(body: GenerateBody) -> Ask:
    for name in ("suffix", "images", "template", "context"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported here", param=name)
    fields = common_fields(body)
    if body.raw:
        if "response_format" in fields:
            raise ApiError(400, "format needs a templated prompt (raw: false)", param="format")
        fields["prompt"] = body.prompt
        return text_ask(validated(CompletionRequest, fields))
    messages = [{"role": "system", "content": body.system}] if body.system else []
    fields["messages"] = [*messages, {"role": "user", "content": body.prompt}]
    return chat_ask(validated(ChatCompletionRequest, fields))


def final(model: str, choice: Choice, started: float, extra: dict[str, Any]) -> dict[str, Any]:
    took = int((time.perf_counter() - started) * 1e9)
    return {
        "model": model,
        "created_at": now(),
        **extra,
        "done": True,
        "done_reason": "length" if choice.finish_reason == "length" else "stop",
        "total_duration": took,
        "load_duration": 0,
        "prompt_eval_count": choice.prompt_tokens,
        "prompt_eval_duration": 0,
        "eval_count": choice.completion_tokens,
        "eval_duration": took,
    }


def tool_calls(choice_calls: Any) -> list[dict[str, Any]]:
    calls = []
    for call in choice_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = {"_raw": call.arguments}
        calls.append({"function": {"name": call.name, "arguments": arguments}})
    return calls


def chat_piece(chunk: TokenChunk) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": chunk.text}
    if chunk.tool_calls:
        message["tool_calls"] = tool_calls(chunk.tool_calls)
    return {"message": message, **logprobs_of(chunk.logprobs)}


def logprobs_of(logprobs: Any) -> dict[str, Any]:
    """Ollama's ``logprobs``: the tokens' log-probabilities (absent when not asked for)."""
    return {"logprobs": chat_logprobs(logprobs)["content"]} if logprobs else {}
