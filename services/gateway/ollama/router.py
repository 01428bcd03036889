"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/version``; the model
endpoints are in ``model_router``), translated onto the OpenAI path (``serving``), streamed as
Ollama streams: one JSON object per line (NDJSON), the last with ``done: true`` and the counts.

Ollama streams unless the request says ``"stream": false``. Errors leave as
``{"error": "..."}`` (``core.error_shapes``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from libs.contracts import DeploymentState, TokenChunk
from services.gateway.core.answers import Answer, Ask, Choice, start
from services.gateway.core.error_shapes import OllamaError, documented_as
from services.gateway.ollama.protocol import ChatBody, EmbedBody, GenerateBody, model_name
from services.gateway.ollama.serving import (
    chat_piece,
    chat_request,
    final,
    generate_ask,
    logprobs_of,
    now,
    tool_calls,
)
from services.gateway.openai.embeddings import EmbeddingRequest, embed
from services.gateway.openai.serving import chat_ask

VERSION = "0.12.0"  #: the Ollama API version whose fields this follows
ERRORS = documented_as(OllamaError, 400, 401, 404, 413, 429, 503)


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


def ollama_router() -> APIRouter:
    router = APIRouter(prefix="/api", tags=["ollama"])

    async def known(request: Request, model: str) -> DeploymentState:
        """404 for a model not deployed, before any other check of the request."""
        return await request.app.state.completions.deployments.lookup(model_name(model))  # type: ignore[no-any-return]

    async def run(request: Request, ask: Ask, resolved: DeploymentState) -> Answer:
        ask.fit = True
        return await start(request.app.state.completions, ask, resolved)

    @router.post("/chat", responses=ERRORS)
    async def chat(body: ChatBody, request: Request) -> Response:
        resolved = await known(request, body.model)
        answer = await run(request, chat_ask(chat_request(body)), resolved)
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
        resolved = await known(request, body.model)
        answer = await run(request, generate_ask(body), resolved)
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
