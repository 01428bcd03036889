"""Anthropic's Messages API (``POST /v1/messages``), translated onto the OpenAI path
(``serving``). Its answer is Anthropic's message, or Anthropic's event stream in its order:
``message_start``, then per content block ``content_block_start`` (the first followed by
``ping``), its deltas and ``content_block_stop``, then ``message_delta`` (``stop_reason``,
usage) and ``message_stop``. Errors leave in Anthropic's shape
(``{"type": "error", "error": {...}}``: ``core.error_shapes``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.gateway.anthropic.protocol import MessageOut, MessagesRequest
from services.gateway.anthropic.serving import openai_request, stop_of, whole
from services.gateway.core.answers import Answer, served_by, start
from services.gateway.core.error_shapes import AnthropicError, documented_as
from services.gateway.core.ids import new_id
from services.gateway.openai.serving import chat_ask


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


def anthropic_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["anthropic"])

    errors = documented_as(AnthropicError, 400, 401, 404, 413, 429, 503)

    @router.post("/messages", response_model=MessageOut, responses=errors)
    async def messages(
        body: MessagesRequest, request: Request, response: Response
    ) -> Response | MessageOut:
        service = request.app.state.completions
        resolved = await service.deployments.lookup(body.model)
        ask = chat_ask(openai_request(body))
        ask.fit = True
        if body.top_k is not None:
            ask.body["top_k"] = body.top_k
            ask.fields = (*ask.fields, "top_k")
        answer = await start(service, ask, resolved)
        mid = new_id("msg")
        if body.stream:
            return stream(answer, mid, body.model)
        [choice] = await answer.collect()
        served_by([choice], response)
        return whole(choice, mid, body.model)

    return router
