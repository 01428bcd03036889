"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/version``; the model
endpoints are in ``ollama_models``), translated onto the OpenAI path, streamed as Ollama
streams: one JSON object per line (NDJSON), the last with ``done: true`` and the counts.

Ollama streams unless the request says ``"stream": false``. ``/api/generate`` applies the
model's chat template to its prompt (a user turn after the optional ``system``) unless ``raw``
is set, as Ollama does. ``options`` the engines cannot honour are refused by name. Errors leave
as ``{"error": "..."}`` (``error_shapes``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from libs.contracts import TokenChunk
from services.gateway.answers import Answer, Ask, Choice, start
from services.gateway.embeddings import EmbeddingRequest, Input, embed
from services.gateway.error_shapes import OllamaError, documented_as
from services.gateway.ollama_models import model_name
from services.gateway.openai_api import (
    MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.gateway.openai_ask import chat_ask, chat_logprobs, text_ask

VERSION = "0.12.0"  #: the Ollama API version whose fields this follows
Text = Annotated[str, Field(max_length=200_000)]
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
ERRORS = documented_as(OllamaError, 400, 401, 404, 413, 429, 503)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(max_length=64)]
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: Annotated[str, Field(max_length=64)] | None = None


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    stream: bool = True
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatBody(_Base):
    messages: Annotated[list[ChatMessage], Field(max_length=256)] = Field(default_factory=list)
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None


class GenerateBody(_Base):
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    input: Input | Annotated[list[Input], Field(min_length=1, max_length=64)]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None
    dimensions: Annotated[int, Field(ge=1, le=65536)] | None = None


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def common_fields(body: _Base) -> dict[str, Any]:
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


def ndjson(
    answer: Answer, model: str, piece: Callable[[TokenChunk], dict[str, Any]], last: str
) -> StreamingResponse:
    """One JSON line per piece, then the final one with the counts (``last`` names the
    empty field it carries: ``message`` or ``response``)."""
    started = time.perf_counter()

    async def lines() -> AsyncIterator[str]:
        choice = Choice(0)
        async for _, chunk in answer.items():
            if chunk.finish_reason == "error":
                yield json.dumps({"error": chunk.error or "generation failed"}) + "\n"
                return
            choice.add(chunk)
            if not chunk.finished and (chunk.text or chunk.tool_calls or chunk.logprobs):
                body = {"model": model, "created_at": now(), **piece(chunk), "done": False}
                yield json.dumps(body) + "\n"
        empty: Any = {"role": "assistant", "content": ""} if last == "message" else ""
        yield json.dumps(final(model, choice, started, {last: empty})) + "\n"

    return StreamingResponse(
        lines(), media_type="application/x-ndjson", background=BackgroundTask(answer.close)
    )


def chat_piece(chunk: TokenChunk) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": chunk.text}
    if chunk.tool_calls:
        message["tool_calls"] = tool_calls(chunk.tool_calls)
    return {"message": message, **logprobs_of(chunk.logprobs)}


def logprobs_of(logprobs: Any) -> dict[str, Any]:
    """Ollama's ``logprobs``: the tokens' log-probabilities (absent when not asked for)."""
    return {"logprobs": chat_logprobs(logprobs)["content"]} if logprobs else {}


def ollama_router() -> APIRouter:
    router = APIRouter(prefix="/api", tags=["ollama"])

    async def known(request: Request, model: str) -> None:
        """404 for a model not deployed, before any other check of the request."""
        await request.app.state.completions.deployments.lookup(model_name(model))

    async def run(request: Request, ask: Ask) -> Answer:
        ask.fit = True
        return await start(request.app.state.completions, ask)

    @router.post("/chat", responses=ERRORS)
    async def chat(body: ChatBody, request: Request) -> Response:
        await known(request, body.model)
        answer = await run(request, chat_ask(chat_request(body)))
        if body.stream:
            return ndjson(answer, body.model, chat_piece, "message")
        started = time.perf_counter()
        [choice] = await answer.collect()
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
        if choice.tool_calls:
            message["tool_calls"] = tool_calls(choice.tool_calls)
        return Response(
            json.dumps(final(body.model, choice, started, {"message": message})),
            media_type="application/json",
        )

    @router.post("/generate", responses=ERRORS)
    async def generate(body: GenerateBody, request: Request) -> Response:
        await known(request, body.model)
        answer = await run(request, generate_ask(body))
        if body.stream:
            return ndjson(
                answer,
                body.model,
                lambda c: {"response": c.text, **logprobs_of(c.logprobs)},
                "response",
            )
        started = time.perf_counter()
        [choice] = await answer.collect()
        extra = {"response": "".join(choice.text)}
        return Response(
            json.dumps(final(body.model, choice, started, extra)), media_type="application/json"
        )

    @router.post("/embed", responses=ERRORS)
    async def embed_(body: EmbedBody, request: Request) -> dict[str, Any]:
        found = await embed(
            request.app.state.completions,
            EmbeddingRequest(
                model=model_name(body.model), input=body.input, dimensions=body.dimensions
            ),
        )
        vectors = [d.embedding for d in found.data]
        count = found.usage.prompt_tokens
        return {"model": body.model, "embeddings": vectors, "prompt_eval_count": count}

    @router.get("/version", responses=documented_as(OllamaError, 401, 429))
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    return router
