"""A worker whose deployment runs in an engine server process (vLLM, llama.cpp's server).

A ``load`` task of a deployment's first shard starts (or keeps) the engine's server for it,
beside the shard-task consumer (its message is kept until the start ends), so an unload or a
newer task taken meanwhile supersedes the start instead of waiting behind it;
each request streams from the server token by token into ``TokenChunk``s, from index
``len(generated_token_ids)`` on, so a request re-run after a migration continues where the
user's stream stopped. Requests of every epoch wait while the server starts (up to ``park_s``).
A server that dies is started again for the same task, and the requests it was running carry
on from their last token once it is back; a newer placement (the owner re-sends its requests
there) ends them instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from libs.agents.emulated_fleet import shard_intensity, work_key
from libs.contracts import (
    HIDDEN,
    TOKENS,
    ContractError,
    GenerationCancel,
    GenerationRequest,
    ShardTask,
    TokenChunk,
)
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus, Delivery, Unsubscribe
from libs.runtime.tracing import carried
from services.worker.base import DeviceWorker, failure
from services.worker.engine_server import EngineError, EngineServer
from services.worker.llama_prompts import PromptRefused, Reply
from services.worker.llama_server import LlamaServer
from services.worker.metrics import WorkerMetrics
from services.worker.prompts import refusal

log = logging.getLogger(__name__)

FINISH = {"stop": "stop", "length": "length"}
FINISH_PROMPT = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
#: The most characters of text a ``TokenChunk`` carries.
TEXT_MAX = 4096
#: Seconds between attempts to start a server again after it died.
RESTART_S = 1.0


class ServedWorker(DeviceWorker):
    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        make_server: Callable[[ShardTask], EngineServer],
        *,
        max_active: int = 16,
        park_s: float = 60.0,
        start_s: float = 300.0,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(bus, device, metrics, clock)
        self.make_server = make_server
        self.max_active, self.park_s, self.start_s = max_active, park_s, start_s
        self.task: ShardTask | None = None
        self.server: EngineServer | None = None
        self.ready = asyncio.Event()
        self.running: dict[str, asyncio.Task[None]] = {}
        self.watcher: asyncio.Task[None] | None = None
        #: The engine's start in flight (``_load``), off the shard-task consumer's callback.
        self.starting: asyncio.Task[None] | None = None

    # -- what an engine decides ----------------------------------------------------------------
    def refusal(self, task: ShardTask) -> str | None:
        """Why this worker cannot run the first shard ``task`` names (None: it can)."""
        return None

    def same_server(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether the server started for ``current`` serves ``task`` too (a newer epoch)."""
        return True

    async def subscribe_more(self) -> list[Unsubscribe]:
        """Hidden-state frames are the torch ring's: one sent here is refused and counted."""
        return [
            await self.bus.subscribe_bytes(HIDDEN.pattern(device_id=self.device_id), self.on_hidden)
        ]

    async def on_hidden(self, delivery: Delivery) -> None:
        detail = f"{self.device_id} runs no torch shard: hidden-state frames do not belong here"
        self.refuse(HIDDEN.name, ContractError("not_served", detail))

    async def close(self) -> None:
        await super().close()
        for job in list(self.running.values()):
            job.cancel()
        await self._stop_server()

    # -- shard tasks ---------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> asyncio.Task[None] | None:
        """Take a shard task at once: a load that needs an engine started returns the start
        (``_load``), which runs off the consumer's callback, so an unload or a newer task
        arriving meanwhile is taken without waiting and supersedes it."""
        current = self.task
        same = current is not None and current.deployment_id == task.deployment_id
        if task.action == "unload":
            if same and current is not None and current.epoch <= task.epoch:
                self.task = None  # first: a start in flight sees it is superseded
                await self._stop_server()
                self.device.unassign(work_key(current))
                await self.status(task, "unloaded")
            return None
        if same and current is not None and current.epoch >= task.epoch:
            if current.epoch == task.epoch and self.ready.is_set():
                # A repeat of what serves here (a scheduler that took over re-sends the load
                # tasks of its plans): say so again, its first answer may have been lost.
                await self.status(task, "loaded")
            return None  # else older than what runs here, or its start in flight answers
        reason = self.refusal(task)
        if reason is None and current is not None and not same:
            reason = f"{self.device_id} already serves {current.deployment_id}"
        if reason is not None:
            await self.status(task, "refused", reason)
            return None
        self.task = task  # requests of this epoch wait for `ready` from now on
        if current is not None:
            self.device.unassign(work_key(current))
        if current is not None and self.ready.is_set() and self.same_server(current, task):
            self.device.assign(work_key(task), shard_intensity(task))  # loaded already
            await self.status(task, "loaded")  # the same server, moved to a newer epoch
            return None
        try:
            await self._stop_server()  # and a start in flight: this task supersedes it
        except Exception:
            self.task = None  # delivered again, it is taken anew (not for a repeat)
            raise
        self.starting = asyncio.create_task(self._load(task))
        return self.starting

    async def _load(self, task: ShardTask) -> None:
        """Start the engine for ``task`` and report how it went. Returns once ``task`` is
        done with: serving, failed, or superseded (an unload or a newer task came meanwhile:
        that one reports); cancelled only when the worker closes, so that ``task`` is
        delivered again to its next process."""
        try:
            load_s = await self._start(task)
        except asyncio.CancelledError:
            if self.task is task:
                raise  # the worker stops
            self._loaded((task.deployment_id, task.shard_index, task.epoch))  # superseded
            return
        except EngineError as exc:
            if self.task is not task:
                self._loaded((task.deployment_id, task.shard_index, task.epoch))  # superseded
                return
            log.error("engine failed to start", extra={"reason": str(exc)})
            self.device.unassign(work_key(task))
            self.task = None
            await self.status(task, "failed", str(exc)[:2000])
            return
        log.info("serving", extra={"deployment_id": task.deployment_id, "load_s": load_s})
        # The device works from now on: a refused or failed start leaves its power and load be.
        self.device.assign(work_key(task), shard_intensity(task))
        await self.status(task, "loaded", load_s=load_s)

    async def _start(self, task: ShardTask) -> float:
        """Start a server for ``task`` (it stops itself when it fails) and watch it; the
        shard is reported loading meanwhile (its caller reports how it ended)."""
        await self.begin_loading(task)
        server = self.server = self.make_server(task)
        try:
            load_s = await server.start(self.start_s)
        except EngineError:
            if self.server is server:
                self.server = None
            raise
        if self.task is not task or self.server is not server:  # a newer task came meanwhile
            await server.stop()
            raise EngineError("superseded by a newer task while starting")
        self.ready.set()
        self.watcher = asyncio.create_task(self._watch(task, server))
        return load_s

    async def _watch(self, task: ShardTask, server: EngineServer) -> None:
        """Start the server again when it dies under ``task`` (a peer lost, a crash), every
        ``RESTART_S`` until it starts or another task replaces this one."""
        assert server.proc is not None
        await server.proc.wait()
        if self.task is not task or self.server is not server:
            return  # stopped on purpose
        self.ready.clear()
        log.warning("engine exited; starting it again", extra={"tail": server.tail()})
        await server.stop()
        key = (task.deployment_id, task.shard_index, task.epoch)
        given_up_at = time.monotonic() + self.start_s
        while self.task is task:
            try:
                load_s = await self._start(task)
                await self.status(task, "loaded", load_s=load_s)  # serving again
                return
            except EngineError as exc:
                self._loaded(key)  # no "loading" reports between the tries
                if time.monotonic() >= given_up_at and self.task is task:
                    # Reported failed, so that the scheduler re-plans without this device.
                    log.error("engine did not start again; given up", extra={"reason": str(exc)})
                    self.task = None
                    self.device.unassign(work_key(task))
                    await self.status(task, "failed", f"engine did not restart: {exc}"[:2000])
                    return
                log.warning("engine did not start again", extra={"reason": str(exc)[:300]})
                await asyncio.sleep(RESTART_S)
            except asyncio.CancelledError:
                self._loaded(key)  # stopped for an unload or a newer task
                raise

    async def _stop_server(self) -> None:
        """Stop the engine, and its start if one is in flight (waiting until it has ended)."""
        self.ready.clear()
        starting, self.starting = self.starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait([starting])
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.cancel()
        server, self.server = self.server, None
        if server is not None:
            await server.stop()

    # -- requests ------------------------------------------------------------------------------
    async def on_generate(self, request: GenerationRequest, delivery: Delivery) -> None:
        if len(self.running) >= self.max_active:
            self.metrics.refused.inc()
            await self.emit(
                failure(request, f"{self.device_id} is busy: {self.max_active} requests")
            )
            return
        earlier = self.running.get(request.request_id)
        if earlier is not None:
            earlier.cancel()  # sent again by its owner: this run replaces that one
        job = asyncio.create_task(self._serve(request))
        self.running[request.request_id] = job
        job.add_done_callback(lambda _: self._finished(request.request_id, job))

    async def on_cancel(self, cancel: GenerationCancel, delivery: Delivery) -> None:
        job = self.running.get(cancel.request_id)
        if job is not None:
            job.cancel()
            log.info("cancelled", extra={"request_id": cancel.request_id})

    def _finished(self, request_id: str, job: asyncio.Task[None]) -> None:
        if self.running.get(request_id) is job:
            del self.running[request_id]
        self._update_gauges()

    async def _serve(self, request: GenerationRequest) -> None:
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
            device_id=self.device_id,
            epoch=request.epoch,
            ts=self.clock(),
        )
        while True:
            engine = await self._engine_for(request)
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
                            await self.emit(self._token(request, len(generated), token, text))
                            generated.append(token)
                        self._update_gauges()
                        if piece.finish_reason is not None:
                            reason = FINISH.get(piece.finish_reason, "error")
                            update = {"finish_reason": reason, "stop_sequence": piece.stop_sequence}
                            last = last.model_copy(update=update)
                done = {"completion_tokens": len(generated), "index": len(generated)}
                await self.emit(last.model_copy(update={**done, "ts": time.time()}))
                return
            except Exception as exc:  # the engine refused it, or went away
                if await alive(server):
                    log.warning("request failed", extra={"request_id": request.request_id})
                    with contextlib.suppress(Exception):
                        await self.emit(failure(request, f"{type(exc).__name__}: {exc}"))
                    return
                if self.task is not task:
                    return  # stopped for a newer placement: the owner re-runs it there
                # The server died under it: carry on from the last token once it is back.
                await asyncio.sleep(0.1)

    async def _engine_for(
        self, request: GenerationRequest
    ) -> tuple[ShardTask, EngineServer] | None:
        """This request's engine once it is up; None when none will come here (the request's
        failure is sent) or the request belongs to an older placement (its owner re-runs it
        on the newer one)."""
        try:
            await asyncio.wait_for(self.ready.wait(), self.park_s)
        except TimeoutError:
            await self.emit(failure(request, f"no engine for {request.deployment_id} here"))
            return None
        task, server = self.task, self.server
        if task is None or server is None or task.deployment_id != request.deployment_id:
            await self.emit(failure(request, f"{request.deployment_id} is not served here"))
            return None
        if request.epoch < task.epoch:
            return None
        return task, server

    async def _serve_prompt(self, request: GenerationRequest) -> None:
        """A request as OpenAI's fields: its answer's pieces from the engine, the first
        ``delivered`` skipped (a re-run with the same seed: the user has them). An engine of
        token ids runs ``prompt_token_ids`` instead, or refuses a field it cannot honour."""
        prompt = request.prompt
        assert prompt is not None
        while True:
            engine = await self._engine_for(request)
            if engine is None:
                return
            task, server = engine
            if not isinstance(server, LlamaServer):
                refused = refusal(request, server.engine)
                if refused is not None:
                    await self.emit(refused.model_copy(update={"device_id": self.device_id}))
                    return
                bare = request.model_copy(update={"prompt": None})
                await self._serve(bare)
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
                        await self.emit(
                            self._piece(
                                request, max(index, request.delivered), **done, finished=True
                            )
                        )
                        return
                    if index >= request.delivered and plain(reply):
                        await self._emit_text(request, index, reply.text)
                    elif index >= request.delivered:
                        fields = {
                            "text": reply.text,
                            "tool_calls": reply.tool_calls,
                            "embedding": reply.embedding,
                        }
                        await self.emit(
                            self._piece(request, index, **fields, logprobs=reply.logprobs)
                        )
                    index += 1
                    if index % 16 == 1:  # a piece changes no gauge: refreshed now and then
                        self._update_gauges()
                return
            except PromptRefused as exc:
                refused = failure(request, str(exc)).model_copy(
                    update={"invalid": exc.field, "index": request.delivered}
                )
                await self.emit(refused)
                return
            except Exception as exc:  # the engine went away
                if await alive(server):
                    log.warning("request failed", extra={"request_id": request.request_id})
                    with contextlib.suppress(Exception):
                        await self.emit(failure(request, f"{type(exc).__name__}: {exc}"))
                    return
                if self.task is not task:
                    return  # stopped for a newer placement: the owner re-runs it there
                # The server died under it: run it again once it is back, skipping what went.
                request = request.model_copy(update={"delivered": max(index, request.delivered)})
                await asyncio.sleep(0.1)

    async def _emit_text(self, request: GenerationRequest, index: int, text: str) -> None:
        """A piece of text alone (the hot path, once per token): its ``TokenChunk`` as JSON of
        the fields it sets, written here rather than a model built and dumped (the gateway
        validates it as a ``TokenChunk`` all the same)."""
        fields = {"request_id": request.request_id, "index": index, "text": text}
        fields.update(device_id=self.device_id, epoch=request.epoch, ts=time.time())
        subject = TOKENS.subject(request_id=request.request_id, device_id=self.device_id)
        await self.bus.publish_bytes(subject, json.dumps(fields).encode())

    def _piece(self, request: GenerationRequest, index: int, **fields: Any) -> TokenChunk:
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            device_id=self.device_id,
            epoch=request.epoch,
            ts=time.time(),
            **fields,
        )

    def _token(self, request: GenerationRequest, index: int, token: int, text: str) -> TokenChunk:
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            token_id=token,
            text=text,
            device_id=self.device_id,
            epoch=request.epoch,
            ts=time.time(),
        )

    def _update_gauges(self) -> None:
        self.device.queue_depth = len(self.running)
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.active.set(len(self.running))
        self.metrics.queue_depth.set(0 if self.ready.is_set() else len(self.running))


def plain(reply: Reply) -> bool:
    """Whether ``reply`` is text alone, sent outside a trace (``_emit_text``)."""
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
