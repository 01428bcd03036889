"""A worker whose deployments run in engine server processes (vLLM, llama.cpp's server).

A worker runs a server per deployment it heads (``Hosted``), as many as its memory holds, as
Ollama and GPUStack serve several models on one machine. A ``load`` task of a deployment's
first shard starts (or keeps) that deployment's server, beside the shard-task consumer (its
message is kept until the start ends), so an unload or a newer task taken meanwhile supersedes
the start instead of waiting behind it. A deployment's requests of every epoch wait while its
server starts (up to ``park_s``), then stream from it (``streams.py``). A server that dies is
started again for the same task. A task is refused only for what the engine cannot run or
what the device's memory cannot take beside what it already holds (``no_room``).

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from libs.agents.emulated_fleet import shard_intensity, work_key
from libs.contracts import (
    HIDDEN,
    ContractError,
    GenerationCancel,
    GenerationRequest,
    ShardTask,
)
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus, Delivery
from services.worker.device.metrics import WorkerMetrics
from services.worker.device.processes import EngineError
from services.worker.device.worker import DeviceWorker, failure
from services.worker.served.held import held_gb
from services.worker.served.server import EngineServer
from services.worker.served.streams import Streams

log = logging.getLogger(__name__)

#: Seconds between attempts to start a server again after it died; how long a split's head
#: tries to start it before reporting it failed.
RESTART_S, SPLIT_START_S = 1.0, 15.0
#: Of a device's memory, what the models it runs may hold (the rest: the system, KV caches;
#: the share the device's telemetry reports as available).
MEMORY_SHARE = 0.8


@dataclass(eq=False)
class Hosted:
    """A deployment this worker runs a server for: the first shard's task it runs now, its
    server once started, whether that server is up (``ready``), and the start and the watch
    in flight."""

    task: ShardTask
    ready: asyncio.Event
    server: EngineServer | None = None
    watcher: asyncio.Task[None] | None = None
    starting: asyncio.Task[None] | None = None


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
        #: The deployments this worker runs a server for, by deployment id.
        self.hosted: dict[str, Hosted] = {}
        #: Each deployment's "its server is up" (kept across its unload and load again: a
        #: request may wait on it before the deployment's first task comes).
        self.ready_events: dict[str, asyncio.Event] = {}
        self.running: dict[str, asyncio.Task[None]] = {}
        #: Requests waiting for their deployment's server to come up.
        self.parked = 0
        self.streams = Streams(self)

    # -- what a served engine kind implements ---------------------------------------------------
    @abstractmethod
    def refusal(self, task: ShardTask) -> str | None:
        """Why this worker cannot run the first shard ``task`` names (None: it can)."""

    def lent_tasks(self) -> Iterable[ShardTask]:
        """The tasks of layers this device runs for other devices' servers (none: an engine
        kind that lends no layers)."""
        return ()

    def no_room(self, task: ShardTask) -> str | None:
        """Why this device's memory cannot take ``task`` beside what it holds (None: it can):
        its share of the model's file and theirs against ``MEMORY_SHARE`` of its memory."""
        held = [
            t
            for t in [*(h.task for h in self.hosted.values()), *self.lent_tasks()]
            if t.deployment_id != task.deployment_id
        ]
        limit = self.device.memory_limit_gb * MEMORY_SHARE
        need, holding = held_gb(task), sum(held_gb(t) for t in held)
        if need + holding <= limit:
            return None
        names = ", ".join(sorted({t.deployment_id for t in held})) or "nothing"
        return (
            f"{self.device_id}'s memory cannot take {task.deployment_id}: {need:.1f} GB asked, "
            f"{holding:.1f} GB held by {names}, {limit:.1f} GB for models"
        )

    def runs(self, task: ShardTask) -> bool:
        """Whether ``task`` is still what this worker runs for its deployment (not unloaded,
        not superseded by a newer task)."""
        hosted = self.hosted.get(task.deployment_id)
        return hosted is not None and hosted.task is task

    def ready_of(self, deployment_id: str) -> asyncio.Event:
        return self.ready_events.setdefault(deployment_id, asyncio.Event())

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
        for hosted in list(self.hosted.values()):
            await self._stop_server(hosted)

    # -- shard tasks ---------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> asyncio.Task[None] | None:
        """Take a shard task at once: a load that needs an engine started returns the start
        (``_load``), which runs off the consumer's callback, so an unload or a newer task
        arriving meanwhile is taken without waiting and supersedes it. A task for layers lent
        to another device's server is the engine kind's (``on_lent_task``). Each deployment
        has its own server: one's tasks never stop another's."""
        if await self.on_lent_task(task):
            return None
        hosted = self.hosted.get(task.deployment_id)
        current = hosted.task if hosted is not None else None
        if task.action == "unload":
            if hosted is not None and current is not None and current.epoch <= task.epoch:
                del self.hosted[task.deployment_id]  # first: a start in flight is superseded
                await self._stop_server(hosted)
                self.device.unassign(work_key(current))
                await self.status(task, "unloaded")
            return None
        if hosted is not None and current is not None and current.epoch >= task.epoch:
            if current.epoch == task.epoch and hosted.ready.is_set():
                # A repeat of what serves here (a scheduler that took over re-sends the load
                # tasks of its plans): say so again, its first answer may have been lost.
                await self.status(task, "loaded")
            return None  # else older than what runs here, or its start in flight answers
        reason = self.refusal(task) or self.no_room(task)
        if reason is not None:
            await self.status(task, "refused", reason)
            return None
        if hosted is None:  # requests of this epoch wait for `ready` from now on
            hosted = Hosted(task, self.ready_of(task.deployment_id))
            self.hosted[task.deployment_id] = hosted
        else:
            hosted.task = task
        if current is not None:
            self.device.unassign(work_key(current))
        if current is not None and hosted.ready.is_set() and self.same_server(current, task):
            self.device.assign(work_key(task), shard_intensity(task))  # loaded already
            await self.status(task, "loaded")  # the same server, moved to a newer epoch
            return None
        try:
            await self._stop_server(hosted)  # and a start in flight: this task supersedes it
        except Exception:
            self._drop(task)  # delivered again, it is taken anew (not for a repeat)
            raise
        hosted.starting = asyncio.create_task(self._load(hosted, task))
        return hosted.starting

    def _drop(self, task: ShardTask) -> None:
        """Forget ``task``'s deployment here, if ``task`` is still what runs for it."""
        if self.runs(task):
            del self.hosted[task.deployment_id]

    async def _load(self, hosted: Hosted, task: ShardTask) -> None:
        """Start the engine for ``task`` and report how it went. Returns once ``task`` is
        done with: serving, failed, or superseded (an unload or a newer task came meanwhile:
        that one reports); cancelled only when the worker closes, so that ``task`` is
        delivered again to its next process."""
        try:
            load_s = await self._first_start(hosted, task)
        except asyncio.CancelledError:
            if self.runs(task):
                raise  # the worker stops
            self._loaded((task.deployment_id, task.shard_index, task.epoch))  # superseded
            return
        except EngineError as exc:
            if not self.runs(task):
                self._loaded((task.deployment_id, task.shard_index, task.epoch))  # superseded
                return
            log.error("engine failed to start", extra={"reason": str(exc)})
            self.device.unassign(work_key(task))
            self._drop(task)
            await self.status(task, "failed", str(exc)[:2000])
            return
        log.info("serving", extra={"deployment_id": task.deployment_id, "load_s": load_s})
        # The device works from now on: a refused or failed start leaves its power and load be.
        self.device.assign(work_key(task), shard_intensity(task))
        await self.status(task, "loaded", load_s=load_s)

    async def _first_start(self, hosted: Hosted, task: ShardTask) -> float:
        """``_start``; a split's head tries again every ``RESTART_S`` for up to
        ``SPLIT_START_S``: the devices it runs layers on take their own tasks at their own pace
        (a slow one behind a link lets its head in later), and the engine fails while one does
        not. A split that cannot start is still reported failed soon (the scheduler re-plans)."""
        given_up_at = time.monotonic() + SPLIT_START_S
        while True:
            try:
                return await self._start(hosted, task)
            except EngineError as exc:
                late = time.monotonic() >= given_up_at
                if task.shard_count <= 1 or late or not self.runs(task):
                    raise
                log.warning("split not started; trying again", extra={"reason": str(exc)[:300]})
                await asyncio.sleep(RESTART_S)

    async def _start(self, hosted: Hosted, task: ShardTask) -> float:
        """Start a server for ``task`` (it stops itself when it fails) and watch it, once this
        host holds what it reads (``hold_weights``); the shard is reported loading meanwhile
        (its caller reports how it ended)."""
        try:
            await self.hold_weights(task)
            return await self._start_server(hosted, task)
        finally:
            self.fetching.pop((task.deployment_id, task.shard_index, task.epoch), None)

    async def _start_server(self, hosted: Hosted, task: ShardTask) -> float:
        await self.begin_loading(task)
        server = hosted.server = self.make_server(task)
        try:
            load_s = await server.start(self.start_s)
        except EngineError:
            if hosted.server is server:
                hosted.server = None
            raise
        if not self.runs(task) or hosted.server is not server:  # a newer task came meanwhile
            await server.stop()
            raise EngineError("superseded by a newer task while starting")
        hosted.ready.set()
        hosted.watcher = asyncio.create_task(self._watch(hosted, task, server))
        return load_s

    async def _watch(self, hosted: Hosted, task: ShardTask, server: EngineServer) -> None:
        """Start the server again when it dies under ``task`` (a peer lost, a crash), every
        ``RESTART_S`` until it starts or another task replaces this one."""
        assert server.proc is not None
        await server.proc.wait()
        if not self.runs(task) or hosted.server is not server:
            return  # stopped on purpose
        hosted.ready.clear()
        log.warning("engine exited; starting it again", extra={"tail": server.tail()})
        await server.stop()
        key = (task.deployment_id, task.shard_index, task.epoch)
        given_up_at = time.monotonic() + self.start_s
        while self.runs(task):
            try:
                load_s = await self._start(hosted, task)
                await self.status(task, "loaded", load_s=load_s)  # serving again
                return
            except EngineError as exc:
                self._loaded(key)  # no "loading" reports between the tries
                if time.monotonic() >= given_up_at and self.runs(task):
                    # Reported failed, so that the scheduler re-plans without this device.
                    log.error("engine did not start again; given up", extra={"reason": str(exc)})
                    self._drop(task)
                    self.device.unassign(work_key(task))
                    await self.status(task, "failed", f"engine did not restart: {exc}"[:2000])
                    return
                log.warning("engine did not start again", extra={"reason": str(exc)[:300]})
                await asyncio.sleep(RESTART_S)
            except asyncio.CancelledError:
                self._loaded(key)  # stopped for an unload or a newer task
                raise

    async def _stop_server(self, hosted: Hosted) -> None:
        """Stop a deployment's engine, and its start if one is in flight (waiting until it
        has ended)."""
        hosted.ready.clear()
        starting, hosted.starting = hosted.starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait([starting])
        watcher, hosted.watcher = hosted.watcher, None
        if watcher is not None:
            watcher.cancel()
        server, hosted.server = hosted.server, None
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
        """This request's engine once it is up (its deployment's server); None when none will
        come here (the request's failure is sent) or the request belongs to an older placement
        (its owner re-runs it on the newer one)."""
        ready = self.ready_of(request.deployment_id)
        parked = not ready.is_set()
        if parked:
            self.parked += 1
            self.update_gauges()
        try:
            await asyncio.wait_for(ready.wait(), self.park_s)
        except TimeoutError:
            await self.emit(failure(request, f"no engine for {request.deployment_id} here"))
            return None
        finally:
            if parked:
                self.parked -= 1
        hosted = self.hosted.get(request.deployment_id)
        if hosted is None or hosted.server is None:
            await self.emit(failure(request, f"{request.deployment_id} is not served here"))
            return None
        if request.epoch < hosted.task.epoch:
            return None
        return hosted.task, hosted.server

    def update_gauges(self) -> None:
        self.device.queue_depth = len(self.running)
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.active.set(len(self.running))
        self.metrics.queue_depth.set(self.parked)
