"""The requests a served worker streams from its engine server, one job each.

Each request streams from the server token by token into ``TokenChunk``s, from index
``len(generated_token_ids)`` on, so a request re-run after a migration continues where the
user's stream stopped; a request of OpenAI's fields (``Prompt``) streams the engine's answer
pieces, the first ``delivered`` skipped. A server that dies under a request is started again by
its worker, and the request carries on from its last token once it is back; a newer placement
(the owner re-sends its requests there) ends it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from libs.contracts import TOKENS, GenerationRequest, ShardTask, TokenChunk
from libs.runtime.bus import Bus
from libs.runtime.tracing import carried
from services.worker.device.processes import EngineError
from services.worker.device.prompts import refusal
from services.worker.device.worker import failure
from services.worker.served.llama_prompts import PromptRefused, Reply
from services.worker.served.llama_server import LlamaServer
from services.worker.served.server import EngineServer

log = logging.getLogger(__name__)

FINISH = {"stop": "stop", "length": "length"}
FINISH_PROMPT = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
#: The most characters of text a ``TokenChunk`` carries.
TEXT_MAX = 4096


class Serving(Protocol):
    """What a request's stream needs of the worker it runs on (``ServedWorker``)."""

    device_id: str
    bus: Bus
    clock: Callable[[], float]

    def runs(self, task: ShardTask) -> bool:
        """Whether ``task`` is still what the worker runs for its deployment."""

    async def emit(self, chunk: TokenChunk) -> None:
        """Publish a chunk on ``TOKENS``, counting a token."""

    async def engine_for(self, request: GenerationRequest) -> tuple[ShardTask, EngineServer] | None:
        """The task and server to run ``request`` on once they are up; None when there will
        be none (its failure sent) or it belongs to an older placement."""

    def update_gauges(self) -> None:
        """Refresh the device's and the metrics' readings of the requests in flight."""


class Streams:
    """Streams requests from the engine of ``worker`` (it holds the jobs, this runs them)."""

    def __init__(self, worker: Serving) -> None:
        self.worker = worker

    async def serve(self, request: GenerationRequest) -> None:
        """Stream ``request`` from the engine, as token ids or as OpenAI's fields; through a
        restart of the engine under it, from where it stopped."""
        if request.prompt is not None:
            await self._serve_prompt(request)
            return
        index = len(request.generated_token_ids)
        generated = list(request.generated_token_ids)
        last = TokenChunk(
            request_id=request.request_id,
            index=index,
            finished=True,
            finish_reason="length",
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=index,
            device_id=self.worker.device_id,
            epoch=request.epoch,
            ts=self.worker.clock(),
        )
        while True:
            engine = await self.worker.engine_for(request)
            if engine is None:
                return
            task, server = engine
            left = request.sampling.max_tokens - len(generated)
            try:
                if left > 0:
                    prompt = [*request.prompt_token_ids, *generated]
                    async for piece in server.complete(prompt, request.sampling, left):
                        for i, token in enumerate(piece.token_ids):
                            text = piece.text if i == len(piece.token_ids) - 1 else ""
                            await self.worker.emit(self.token(request, len(generated), token, text))
                            generated.append(token)
                        self.worker.update_gauges()
                        if piece.finish_reason is not None:
                            reason = FINISH.get(piece.finish_reason, "error")
                            update = {"finish_reason": reason, "stop_sequence": piece.stop_sequence}
                            last = last.model_copy(update=update)
                done = {"completion_tokens": len(generated), "index": len(generated)}
                await self.worker.emit(last.model_copy(update={**done, "ts": time.time()}))
                return
            except Exception as exc:  # the engine refused it, or went away
                if await self.ends_here(server, task, request, exc):
                    return
                # The server died under it: carry on from the last token once it is back.
                await asyncio.sleep(0.1)

    async def _serve_prompt(self, request: GenerationRequest) -> None:
        """A request as OpenAI's fields: its answer's pieces from the engine, the first
        ``delivered`` skipped (a re-run with the same seed: the user has them). An engine of
        token ids runs ``prompt_token_ids`` instead, or refuses a field it cannot honour."""
        prompt = request.prompt
        assert prompt is not None
        while True:
            engine = await self.worker.engine_for(request)
            if engine is None:
                return
            task, server = engine
            if not request.prompt_token_ids and not prompt.fields and prompt.kind != "embed":
                # No tokenizer on the gateway (a Hugging Face folder's model): the engine's own.
                try:
                    ids = await server.tokenize(prompt)
                except EngineError as exc:
                    await self.worker.emit(failure(request, str(exc)))
                    return
                if ids:
                    request = request.model_copy(update={"prompt_token_ids": ids})
            if not isinstance(server, LlamaServer):
                refused = refusal(request, server.engine)
                if refused is not None:
                    await self.worker.emit(
                        refused.model_copy(update={"device_id": self.worker.device_id})
                    )
                    return
                bare = request.model_copy(update={"prompt": None})
                await self.serve(bare)
                return
            index = 0
            try:
                async for reply in server.answer(prompt, request.sampling):
                    if reply.finish_reason is not None:
                        done = {
                            "finish_reason": FINISH_PROMPT.get(reply.finish_reason, "stop"),
                            "prompt_tokens": reply.prompt_tokens,
                            "completion_tokens": reply.completion_tokens,
                            "stop_sequence": reply.stop_sequence,
                        }
                        await self.worker.emit(
                            self.piece(
                                request, max(index, request.delivered), **done, finished=True
                            )
                        )
                        return
                    if index >= request.delivered and plain(reply):
                        await self.emit_text(request, index, reply.text)
                    elif index >= request.delivered:
                        fields = {
                            "text": reply.text,
                            "tool_calls": reply.tool_calls,
                            "embedding": reply.embedding,
                        }
                        await self.worker.emit(
                            self.piece(request, index, **fields, logprobs=reply.logprobs)
                        )
                    index += 1
                    if index % 16 == 1:  # a piece changes no gauge: refreshed now and then
                        self.worker.update_gauges()
                return
            except PromptRefused as exc:
                refused = failure(request, str(exc)).model_copy(
                    update={"invalid": exc.field, "index": request.delivered}
                )
                await self.worker.emit(refused)
                return
            except Exception as exc:  # the engine went away
                if await self.ends_here(server, task, request, exc):
                    return
                # The server died under it: run it again once it is back, skipping what went.
                request = request.model_copy(update={"delivered": max(index, request.delivered)})
                await asyncio.sleep(0.1)

    async def ends_here(
        self, server: EngineServer, task: ShardTask, request: GenerationRequest, exc: Exception
    ) -> bool:
        """After ``exc``: whether the request ends here. It does when the engine still runs
        (it refused the request: the request fails, said on its stream) or when the worker
        was given a newer placement (the owner re-runs it there); it goes on, once the
        server is back, when the server died under it."""
        if await alive(server):
            log.warning("request failed", extra={"request_id": request.request_id})
            with contextlib.suppress(Exception):
                await self.worker.emit(failure(request, f"{type(exc).__name__}: {exc}"))
            return True
        return not self.worker.runs(task)

    async def emit_text(self, request: GenerationRequest, index: int, text: str) -> None:
        """A piece of text alone (the hot path, once per token): its ``TokenChunk`` as JSON of
        the fields it sets, written here rather than a model built and dumped (the gateway
        validates it as a ``TokenChunk`` all the same)."""
        fields = {"request_id": request.request_id, "index": index, "text": text}
        fields.update(device_id=self.worker.device_id, epoch=request.epoch, ts=time.time())
        subject = TOKENS.subject(request_id=request.request_id, device_id=self.worker.device_id)
        await self.worker.bus.publish_bytes(subject, json.dumps(fields).encode())

    def piece(self, request: GenerationRequest, index: int, **fields: Any) -> TokenChunk:
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            device_id=self.worker.device_id,
            epoch=request.epoch,
            ts=time.time(),
            **fields,
        )

    def token(self, request: GenerationRequest, index: int, token: int, text: str) -> TokenChunk:
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            token_id=token,
            text=text,
            device_id=self.worker.device_id,
            epoch=request.epoch,
            ts=time.time(),
        )


def plain(reply: Reply) -> bool:
    """Whether ``reply`` is text alone, sent outside a trace (``Streams.emit_text``)."""
    short = len(reply.text) <= TEXT_MAX
    return short and not (reply.tool_calls or reply.logprobs or reply.embedding) and not carried()


async def alive(server: EngineServer, wait_s: float = 1.0) -> bool:
    """Whether ``server``'s process still runs ``wait_s`` after a request to it failed."""
    proc = server.proc
    if proc is None:
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), wait_s)
    return proc.returncode is None
