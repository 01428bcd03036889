"""The OpenAI-compatible routes: chat completions, text completions, models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from libs.contracts import TokenChunk
from libs.models.chat import encode_chat
from services.gateway.completions import Completions, collect, sampling_of, sse
from services.gateway.openai_api import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessageOut,
    CompletionRequest,
    ModelCard,
    ModelList,
    TextChoice,
    TextCompletion,
    Usage,
    chat_chunk,
    documented,
    new_id,
    now_s,
    text_chunk,
)
from services.gateway.settings import GatewaySettings

ERRORS = documented(400, 401, 404, 413, 429, 503)


def _usage(chunk: TokenChunk) -> Usage:
    prompt, completion = chunk.prompt_tokens or 0, chunk.completion_tokens or 0
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def openai_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    def completions(request: Request) -> Completions:
        found: Completions = request.app.state.completions
        return found

    @router.get("/models", response_model=ModelList, responses=ERRORS)
    async def models(request: Request) -> ModelList:
        deployments = request.app.state.deployments  # current: it follows their status
        return ModelList(data=[ModelCard(id=d, created=0) for d in deployments.listed])

    @router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
        service = completions(request)
        deployment = await service.deployments.lookup(body.model)
        tokenizer = await service.tokenizer(deployment)
        ids = encode_chat(tokenizer, [m.model_dump() for m in body.messages])
        sampling = sampling_of(body.max_completion_tokens or body.max_tokens, body)
        service.check(deployment, len(ids), sampling.max_tokens)
        slot = service.admit()
        rid, created = new_id("chatcmpl"), now_s()
        chunks = service.chunks(deployment, ids, sampling, slot)
        if body.stream:
            first = [True]

            def render(chunk: TokenChunk) -> list[dict[str, Any]]:
                out = []
                if first[0]:
                    first[0] = False
                    out.append(chat_chunk(rid, body.model, created, {"role": "assistant"}, None))
                if chunk.text:
                    out.append(chat_chunk(rid, body.model, created, {"content": chunk.text}, None))
                if chunk.finished:
                    out.append(chat_chunk(rid, body.model, created, {}, chunk.finish_reason))
                return out

            include = body.stream_options is not None and body.stream_options.include_usage
            usage = _chat_usage(rid, body.model, created) if include else None
            return sse(chunks, render, usage, slot)
        text, last = await collect(chunks)
        return ChatCompletion(
            id=rid,
            created=created,
            model=body.model,
            choices=[
                ChatChoice(message=ChatMessageOut(content=text), finish_reason=last.finish_reason)
            ],
            usage=_usage(last),
        )

    @router.post("/completions", response_model=TextCompletion, responses=ERRORS)
    async def complete(body: CompletionRequest, request: Request) -> Response | TextCompletion:
        service = completions(request)
        deployment = await service.deployments.lookup(body.model)
        tokenizer = await service.tokenizer(deployment)
        ids = [int(i) for i in tokenizer(body.text())["input_ids"]]
        if not ids:
            ids = [int(tokenizer.bos_token_id or 0)]
        sampling = sampling_of(body.max_tokens or 16, body)
        service.check(deployment, len(ids), sampling.max_tokens)
        slot = service.admit()
        rid, created = new_id("cmpl"), now_s()
        chunks = service.chunks(deployment, ids, sampling, slot)
        if body.stream:

            def render(chunk: TokenChunk) -> list[dict[str, Any]]:
                if chunk.text or chunk.finished:
                    return [text_chunk(rid, body.model, created, chunk.text, chunk.finish_reason)]
                return []

            return sse(chunks, render, None, slot)
        text, last = await collect(chunks)
        return TextCompletion(
            id=rid,
            created=created,
            model=body.model,
            choices=[TextChoice(text=text, finish_reason=last.finish_reason)],
            usage=_usage(last),
        )

    return router


def _chat_usage(rid: str, model: str, created: int):  # type: ignore[no-untyped-def]
    def usage(chunk: TokenChunk) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(chunk).model_dump(),
        }

    return usage
