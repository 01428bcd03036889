"""Anthropic's Messages API (``POST /v1/messages``), translated onto the OpenAI path.

A request becomes an OpenAI chat (system prompt first, ``tool_use`` blocks as assistant tool
calls, ``tool_result`` blocks as tool messages) and runs as one (``answers.start``): the same
placement, limits, keys, metrics and migration. Its answer is Anthropic's message, or
Anthropic's event stream in its order: ``message_start``, then per content block
``content_block_start`` (the first followed by ``ping``), its deltas and
``content_block_stop``, then ``message_delta`` (``stop_reason``, usage) and ``message_stop``.
Errors leave in Anthropic's shape (``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from services.gateway.answers import Answer, Choice, start
from services.gateway.error_shapes import AnthropicError, documented_as
from services.gateway.openai_api import MAX_TOKENS, ApiError, ChatCompletionRequest, new_id
from services.gateway.openai_ask import chat_ask

Text = Annotated[str, Field(max_length=200_000)]
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Block(BaseModel):
    """A content block: ``text``, ``tool_use``, ``tool_result``; others (images, documents,
    thinking) are refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(max_length=64)]
    text: Text | None = None
    id: Annotated[str, Field(max_length=128)] | None = None
    name: Annotated[str, Field(max_length=128)] | None = None
    input: dict[str, Any] | None = None
    tool_use_id: Annotated[str, Field(max_length=128)] | None = None
    content: Text | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=256)]


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, Field(max_length=10_000)] | None = None
    input_schema: dict[str, Any]


class ToolChoiceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(max_length=64)] | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    """Anthropic's request; an unknown field is refused, as Anthropic does."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=256)]
    system: Text | list[Block] | None = None
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
        | None
    ) = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1, le=1000)] | None = None
    stream: bool = False
    tools: Annotated[list[ToolIn], Field(max_length=128)] | None = None
    tool_choice: ToolChoiceIn | None = None
    metadata: dict[str, Any] | None = None
    #: ``format`` (a JSON schema: the output is constrained to it); ``effort`` is a hint the
    #: engines here have no use for.
    output_config: OutputConfig | None = None
    # Hints with nothing to act on here (caching is by prefix anyway), accepted.
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Anthropic's, honoured by no engine here: refused by name.
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: dict[str, int]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))


def openai_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The same chat in OpenAI's words (400 naming a block or field that cannot be)."""
    for name in ("thinking", "container", "mcp_servers"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} is not supported here", param=name)
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _blocks_text(body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        text, calls = [], []
        for block in message.content:
            if block.type == "text":
                text.append(block.text or "")
            elif block.type == "tool_use" and message.role == "assistant":
                arguments = json.dumps(block.input or {})
                function = {"name": block.name or "", "arguments": arguments}
                calls.append({"id": block.id or "", "type": "function", "function": function})
            elif block.type == "tool_result" and message.role == "user":
                content = _text(block.content)
                result = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
                messages.append(result)
            else:
                where = f"messages[{i}].content"
                raise ApiError(400, f"{where}: {block.type} blocks are not supported", param=where)
        if message.role == "assistant" and (text or calls):
            out: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        elif text:
            messages.append({"role": "user", "content": "".join(text)})
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": min(body.max_tokens, MAX_TOKENS),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p or 1.0,
        "stop": body.stop_sequences or None,
    }
    output = body.output_config.format if body.output_config else None
    if output is not None:
        schema = {"name": "output", "schema": output.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.tools and (body.tool_choice is None or body.tool_choice.type != "none"):
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
        choice = body.tool_choice
        if choice is not None and choice.type == "any":
            fields["tool_choice"] = "required"
        elif choice is not None and choice.type == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        if choice is not None and choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{where}: {first.get('msg')}", param=where or None) from None


def _blocks_text(blocks: list[Block]) -> str:
    for block in blocks:
        if block.type != "text":
            raise ApiError(400, f"system: {block.type} blocks are not supported", param="system")
    return "\n".join(block.text or "" for block in blocks)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stream(answer: Answer, mid: str, model: str) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        start_usage = {"input_tokens": answer.prompt_tokens, "output_tokens": 0}
        message = MessageOut(id=mid, model=model, content=[], stop_reason=None, usage=start_usage)
        yield _event("message_start", {"message": message.model_dump()})
        block, kind = -1, ""  # the open content block, and its type
        pinged = False
        async for _, chunk in answer.items():
            if chunk.finish_reason == "error":
                error = {"type": "api_error", "message": chunk.error or "generation failed"}
                yield _event("error", {"error": error})
                return
            if chunk.text and kind != "text":
                if block >= 0:
                    yield _event("content_block_stop", {"index": block})
                block, kind = block + 1, "text"
                text_block = {"type": "text", "text": ""}
                yield _event("content_block_start", {"index": block, "content_block": text_block})
            if not pinged and block >= 0:
                pinged = True
                yield _event("ping", {})
            if chunk.text:
                delta = {"type": "text_delta", "text": chunk.text}
                yield _event("content_block_delta", {"index": block, "delta": delta})
            for call in chunk.tool_calls:
                if block >= 0:
                    yield _event("content_block_stop", {"index": block})
                block, kind = block + 1, "tool_use"
                use = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                yield _event("content_block_start", {"index": block, "content_block": use})
                if not pinged:
                    pinged = True
                    yield _event("ping", {})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield _event("content_block_delta", {"index": block, "delta": delta})
            if chunk.finished:
                if block >= 0:
                    yield _event("content_block_stop", {"index": block})
                usage = {
                    "input_tokens": chunk.prompt_tokens or answer.prompt_tokens,
                    "output_tokens": chunk.completion_tokens or 0,
                }
                stop = stop_of(chunk.finish_reason, chunk.stop_sequence)
                yield _event("message_delta", {"delta": stop, "usage": usage})
                yield _event("message_stop", {})

    return StreamingResponse(
        events(), media_type="text/event-stream", background=BackgroundTask(answer.close)
    )


def whole(choice: Choice, mid: str, model: str) -> MessageOut:
    content: list[dict[str, Any]] = []
    if "".join(choice.text):
        content.append({"type": "text", "text": "".join(choice.text)})
    for call in choice.tool_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = {"_raw": call.arguments}
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    usage = {"input_tokens": choice.prompt_tokens, "output_tokens": choice.completion_tokens}
    stop = stop_of(choice.finish_reason, choice.stop_sequence)
    return MessageOut(id=mid, model=model, content=content, usage=usage, **stop)


def stop_of(finish_reason: str | None, stop_sequence: str | None) -> dict[str, Any]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of an engine's finish: a stop
    sequence the engine names is ``stop_sequence`` (OpenAI's ``stop`` covers it too)."""
    if finish_reason in (None, "stop") and stop_sequence:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": STOP.get(finish_reason or "stop", "end_turn"), "stop_sequence": None}


def anthropic_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["anthropic"])

    errors = documented_as(AnthropicError, 400, 401, 404, 413, 429, 503)

    @router.post("/messages", response_model=MessageOut, responses=errors)
    async def messages(body: MessagesRequest, request: Request) -> Response | MessageOut:
        service = request.app.state.completions
        await service.deployments.lookup(body.model)
        ask = chat_ask(openai_request(body))
        ask.fit = True
        if body.top_k is not None:
            ask.body["top_k"] = body.top_k
            ask.fields = (*ask.fields, "top_k")
        answer = await start(service, ask)
        mid = new_id("msg")
        if body.stream:
            return stream(answer, mid, body.model)
        [choice] = await answer.collect()
        return whole(choice, mid, body.model)

    return router
