"""A worker whose deployment runs in an engine server process (vLLM, llama.cpp's server).

A ``load`` task of a deployment's first shard starts (or keeps) the engine's server for it,
beside the shard-task consumer (its message is kept until the start ends), so an unload or a
newer task taken meanwhile supersedes the start instead of waiting behind it. Requests of every
epoch wait while the server starts (up to ``park_s``), then stream from it (``streams.py``). A
server that dies is started again for the same task.

``ServedWorker`` implements the device's hooks that every served engine shares and calls its own
abstract hooks, which each engine kind implements once (``VllmWorker``, ``LlamaWorker``):
``refusal``, ``same_server``, ``hold_weights`` and ``on_lent_task``, beside the device's
``open_engine``, ``close_engine``, ``tick`` and ``preload``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections.abc import Callable

from libs.agents.emulated_fleet import shard_intensity, work_key
from libs.contracts import HIDDEN, ContractError, GenerationCancel, GenerationRequest, ShardTask
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus, Delivery
from services.worker.device.metrics import WorkerMetrics
from services.worker.device.processes import EngineError
from services.worker.device.worker import DeviceWorker, failure
from services.worker.served.server import EngineServer
from services.worker.served.streams import Streams

log = logging.getLogger(__name__)

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
        self.streams = Streams(self)
        self.watcher: asyncio.Task[None] | None = None
        #: The engine's start in flight (``_load``), off the shard-task consumer's callback.
        self.starting: asyncio.Task[None] | None = None

    # -- what a served engine kind implements ---------------------------------------------------
    @abstractmethod
    def refusal(self, task: ShardTask) -> str | None:
        """Why this worker cannot run the first shard ``task`` names (None: it can)."""

    @abstractmethod
    def same_server(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether the server started for ``current`` serves ``task`` too (a newer epoch)."""

    @abstractmethod
    async def hold_weights(self, task: ShardTask) -> None:
        """Before ``task``'s server starts (and each time it starts again): make sure this
        host holds the model's file it reads, reporting a fetch as the first half of loading
        (``fetching``); raise ``EngineError`` when it cannot."""

    @abstractmethod
    async def on_lent_task(self, task: ShardTask) -> bool:
        """Take ``task`` when it names layers that another device's server runs on this one
        (llama.cpp's RPC server lends them) and return True; False: it is a task for a server
        of this worker's own, which ``on_task`` takes."""

    # -- the device's hooks, as every served engine implements them -----------------------------
    async def on_hidden(self, delivery: Delivery) -> None:
        """Hidden-state frames are the torch ring's: one sent here is refused and counted."""
        detail = f"{self.device_id} runs no torch shard: hidden-state frames do not belong here"
        self.refuse(HIDDEN.name, ContractError("not_served", detail))

    async def expire(self, idle_s: float) -> None:
        """Nothing waits here to expire: a request's job ends with its stream, or its cancel."""

    async def stop_serving(self) -> None:
        """Stop every request's job and the engine (the engine kinds' ``close_engine``)."""
        for job in list(self.running.values()):
            job.cancel()
        await self._stop_server()

    # -- shard tasks ---------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> asyncio.Task[None] | None:
        """Take a shard task at once: a load that needs an engine started returns the start
        (``_load``), which runs off the consumer's callback, so an unload or a newer task
        arriving meanwhile is taken without waiting and supersedes it. A task for layers lent
        to another device's server is the engine kind's (``on_lent_task``)."""
        if await self.on_lent_task(task):
            return None
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
        """Start a server for ``task`` (it stops itself when it fails) and watch it, once this
        host holds what it reads (``hold_weights``); the shard is reported loading meanwhile
        (its caller reports how it ended)."""
        try:
            await self.hold_weights(task)
            return await self._start_server(task)
        finally:
            self.fetching.pop((task.deployment_id, task.shard_index, task.epoch), None)

    async def _start_server(self, task: ShardTask) -> float:
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
        job = asyncio.create_task(self.streams.serve(request))
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
        self.update_gauges()

    async def engine_for(self, request: GenerationRequest) -> tuple[ShardTask, EngineServer] | None:
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

    def update_gauges(self) -> None:
        self.device.queue_depth = len(self.running)
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.active.set(len(self.running))
        self.metrics.queue_depth.set(0 if self.ready.is_set() else len(self.running))
