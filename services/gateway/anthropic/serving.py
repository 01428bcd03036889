"""Anthropic's request as an OpenAI chat, and the answer as Anthropic's message.

A request becomes an OpenAI chat (system prompt first, ``tool_use`` blocks as assistant tool
calls, ``tool_result`` blocks as tool messages) and runs as one (``core.answers.start``): the
same placement, limits, keys, metrics and migration.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from services.gateway.anthropic.protocol import Block, MessageOut, MessagesRequest
from services.gateway.core.answers import MAX_TOKENS, Choice
from services.gateway.core.errors import ApiError
from services.gateway.openai.protocol import ChatCompletionRequest

#: OpenAI's finish reasons as Anthropic's stop reasons.
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


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
