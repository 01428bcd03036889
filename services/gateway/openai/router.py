"""The OpenAI-compatible routes: chat completions, text completions, embeddings, models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from libs.contracts import TokenChunk
from services.gateway.core.answers import Answer, Choice, served_by, start, usage_of
from services.gateway.core.completions import Completions
from services.gateway.core.errors import documented
from services.gateway.core.ids import new_id
from services.gateway.openai.embeddings import EmbeddingList, EmbeddingRequest, embed
from services.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCall,
    now_s,
)
from services.gateway.openai.responses import (
    ChatChoice,
    ChatCompletion,
    ChatMessageOut,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    ToolCallOut,
    Usage,
    chat_chunk,
    chat_logprobs,
    text_chunk,
    text_logprobs,
    tool_call_delta,
)
from services.gateway.openai.serving import chat_ask, refuse_unsupported, text_ask
from services.gateway.settings import GatewaySettings

ERRORS = documented(400, 401, 404, 413, 429, 503)
#: Renders one choice's chunk as OpenAI stream events.
Render = Callable[[int, TokenChunk], list[dict[str, Any]]]


def completions(request: Request) -> Completions:
    found: Completions = request.app.state.completions
    return found


def sse(answer: Answer, render: Render, usage: Callable[[], dict[str, Any]] | None) -> Response:
    """Server-sent events: one ``data:`` line per OpenAI chunk, then ``data: [DONE]``; with
    ``usage``, a last chunk with the whole request's usage (``include_usage``)."""
    totals: dict[int, tuple[int, int]] = {}

    async def events() -> AsyncIterator[str]:
        # If the client goes away the generator is closed, and the generations cancelled.
        async for index, chunk in answer.items():
            if chunk.finish_reason == "error":
                error = {"message": chunk.error, "type": "server_error", "code": "no_capacity"}
                yield f"data: {json.dumps({'error': error})}\n\n"
                break
            events = render(index, chunk)
            if events:  # one write for the chunk's events
                yield "".join(f"data: {json.dumps(event)}\n\n" for event in events)
            if chunk.finished:
                totals[index] = (chunk.prompt_tokens or 0, chunk.completion_tokens or 0)
        else:
            if usage is not None:
                prompt = max((p for p, _ in totals.values()), default=0)
                completion = sum(c for _, c in totals.values())
                counts = {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                }
                yield f"data: {json.dumps({**usage(), 'usage': counts})}\n\n"
        yield "data: [DONE]\n\n"

    # A client gone before the stream began never runs the generator: close the answer.
    return StreamingResponse(
        events(), media_type="text/event-stream", background=BackgroundTask(answer.close)
    )


def openai_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    @router.get("/models", response_model=ModelList, responses=ERRORS)
    async def models(request: Request) -> ModelList:
        deployments = request.app.state.deployments  # current: it follows their status
        return ModelList(data=[ModelCard(id=d, created=0) for d in deployments.listed])

    @router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat(
        body: ChatCompletionRequest, request: Request, response: Response
    ) -> Response | ChatCompletion:
        service = completions(request)
        resolved = await service.deployments.lookup(body.model)  # 404 before any other check
        refuse_unsupported(body)
        answer = await start(service, chat_ask(body), resolved)
        rid, created = new_id("chatcmpl"), now_s()
        if body.stream:
            return sse(
                answer,
                chat_render(rid, body.model, created, body.n),
                _usage_chunk(rid, body.model, created, body.stream_options),
            )
        choices = await answer.collect()
        served_by(choices, response)
        return ChatCompletion(
            id=rid,
            created=created,
            model=body.model,
            choices=[chat_choice(c, bool(body.logprobs)) for c in choices],
            usage=Usage(**usage_of(choices)),
        )

    @router.post("/completions", response_model=TextCompletion, responses=ERRORS)
    async def complete(
        body: CompletionRequest, request: Request, response: Response
    ) -> Response | TextCompletion:
        service = completions(request)
        resolved = await service.deployments.lookup(body.model)
        refuse_unsupported(body)
        answer = await start(service, text_ask(body), resolved)
        rid, created = new_id("cmpl"), now_s()
        if body.stream:
            offsets: dict[int, int] = {}

            def render(index: int, chunk: TokenChunk) -> list[dict[str, Any]]:
                if not (chunk.text or chunk.finished or chunk.logprobs):
                    return []
                logprobs = None
                if body.logprobs:
                    logprobs = text_logprobs(chunk.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(chunk.text)
                return [
                    text_chunk(
                        rid, body.model, created, chunk.text, chunk.finish_reason, index, logprobs
                    )
                ]

            return sse(
                answer,
                render,
                _usage_chunk(rid, body.model, created, body.stream_options, "text_completion"),
            )
        choices = await answer.collect()
        served_by(choices, response)
        return TextCompletion(
            id=rid,
            created=created,
            model=body.model,
            choices=[
                TextChoice(
                    index=c.index,
                    text="".join(c.text),
                    finish_reason=c.finish_reason,
                    logprobs=TextLogprobs(**text_logprobs(c.logprobs)) if body.logprobs else None,
                )
                for c in choices
            ],
            usage=Usage(**usage_of(choices)),
        )

    @router.post("/embeddings", response_model=EmbeddingList, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingList:
        return await embed(completions(request), body)

    return router


def chat_render(rid: str, model: str, created: int, n: int) -> Render:
    """A chat stream's chunks, as OpenAI sends them: the role first, then content and tool
    call deltas, then the finish reason, each choice numbered."""
    started: set[int] = set()
    calls: dict[int, int] = {}

    def render(index: int, chunk: TokenChunk) -> list[dict[str, Any]]:
        out = []
        if index not in started:
            started.add(index)
            out.append(
                chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None, index)
            )
        logprobs = chat_logprobs(chunk.logprobs) if chunk.logprobs else None
        if chunk.text or logprobs:
            out.append(
                chat_chunk(rid, model, created, {"content": chunk.text}, None, index, logprobs)
            )
        if chunk.tool_calls:
            first = calls.get(index, 0)
            calls[index] = first + len(chunk.tool_calls)
            tools = {"tool_calls": tool_call_delta(chunk.tool_calls, first)}
            out.append(chat_chunk(rid, model, created, tools, None, index))
        if chunk.finished:
            out.append(chat_chunk(rid, model, created, {}, chunk.finish_reason, index))
        return out

    return render


def _usage_chunk(
    rid: str, model: str, created: int, options: Any, kind: str = "chat.completion.chunk"
) -> Callable[[], dict[str, Any]] | None:
    if options is None or not options.include_usage:
        return None

    def usage() -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": created, "model": model, "choices": []}

    return usage


def chat_choice(choice: Choice, logprobs: bool) -> ChatChoice:
    """A whole choice: its text (None when it only called tools), its tool calls."""
    text = "".join(choice.text)
    calls = [
        ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
        for t in choice.tool_calls
    ]
    return ChatChoice(
        index=choice.index,
        message=ChatMessageOut(
            content=text if text or not calls else None, tool_calls=calls or None
        ),
        finish_reason=choice.finish_reason,
        logprobs=ChoiceLogprobs(**chat_logprobs(choice.logprobs)) if logprobs else None,
    )
