"""What every worker shares, whatever runs the model: its device, the shard-task consumer,
status and token replies, and the hooks each engine kind implements.

A worker stands in for one device. Whatever runs the model (layer shards in PyTorch, a server
process of vLLM or llama.cpp), it takes ``SHARD_TASK`` from its durable consumer on the ``Bus``,
answers on ``SHARD_STATUS``, takes new requests on ``GENERATION``, cancels on ``CANCEL`` and
hidden-state frames on ``HIDDEN``, streams ``TokenChunk``s on ``TOKENS``, and measures the tokens
per second it really delivers.

``DeviceWorker`` runs all of that and calls the abstract hooks of its section "what an engine
kind implements" (``on_task``, ``on_generate``, ``on_cancel``, ``on_hidden``, ``expire``,
``tick``, ``preload``, ``open_engine``, ``close_engine``); an engine kind implements each once
and calls no implementation of a parent (``services/worker/__init__.py``).

A worker is the one owner of its device's work: it assigns a shard's work to the device once
the shard really loaded and takes it away once unloaded, so the device's reported power and
load follow only what runs. A shard being loaded is reported ``loading`` every
``PROGRESS_EVERY_S`` until its final status (loaded, refused, failed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libs.contracts import (
    CANCEL,
    DEVICE_LEAVING,
    GENERATION,
    HIDDEN,
    SHARD_STATUS,
    SHARD_TASK,
    TOKENS,
    WEIGHTS_PROGRESS,
    ContractError,
    DeviceLeaving,
    GenerationCancel,
    GenerationRequest,
    ShardStatus,
    ShardTask,
    TokenChunk,
    WeightsProgress,
)
from libs.contracts.channels import work_consumer
from libs.devices.emulated import EmulatedDevice
from libs.runtime.acks import Received, Redelivery
from libs.runtime.bus import SHARD_TASKS, Bus, Delivery, RateLimitedLog, Unsubscribe
from services.worker.device.metrics import WorkerMetrics

log = logging.getLogger(__name__)

_refusals = RateLimitedLog()

RATE_WINDOW_S = 10.0
#: Seconds between a loading shard's reports (the deployment's progress follows them).
PROGRESS_EVERY_S = 1.0
#: The share of a load reported before the engine says it is done.
PROGRESS_CAP = 0.95
#: What a first load is expected to take (s), until this worker measured one.
EXPECTED_LOAD_S = 5.0
#: Weights progress is published when this share more has arrived, or this long has passed.
WEIGHTS_STEP = 0.05
WEIGHTS_EVERY_S = 1.0


@dataclass
class Loading:
    """A shard being loaded: its task, when it began (monotonic) and its reporter."""

    task: ShardTask
    began: float
    reporter: asyncio.Task[None] | None = None


class DeviceWorker(ABC):
    #: How the shard-task consumer acknowledges (a test gives a short ack wait).
    redelivery: Redelivery = SHARD_TASKS

    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.device = device
        self.device_id = device.device_id
        self.metrics = metrics or WorkerMetrics()
        self.clock = clock
        self.token_times: collections.deque[float] = collections.deque()
        self._subs: list[Unsubscribe] = []
        #: Shards being loaded, by (deployment, shard, epoch).
        self.loading: dict[tuple[str, int, int], Loading] = {}
        #: What the next load is expected to take: the last one this worker measured.
        self.expected_load_s = EXPECTED_LOAD_S
        #: The newest unload of each deployment this worker was told (whether or not it held
        #: it), as (epoch, sent at): a load of that epoch or an older one, sent before it, is
        #: stale. One sent after it is a new deployment under the same id.
        self.unloaded: dict[str, tuple[int, float]] = {}
        #: Shards whose engine waits for its model's file to arrive first (the llamacpp head
        #: fetching it from the cluster), by (deployment, shard, epoch): the share fetched
        #: (0..1), then None while the engine loads. Their loading reports count the fetch as
        #: the first half (``load_progress``).
        self.fetching: dict[tuple[str, int, int], float | None] = {}
        #: Weights progress messages being published.
        self._sending: set[asyncio.Task[None]] = set()

    # -- what an engine kind implements ---------------------------------------------------------
    @abstractmethod
    async def open_engine(self) -> None:
        """Start what the engine runs beside its subscriptions (the torch ring's compute loop,
        llama.cpp's RPC server); called by ``start`` before any message is taken."""

    @abstractmethod
    async def close_engine(self) -> None:
        """Stop the engine and the work in flight; called by ``close`` once no message comes."""

    @abstractmethod
    async def on_task(self, task: ShardTask) -> asyncio.Task[None] | None:
        """Load or unload the shard a task names (on this device). Returns None once the task
        is done with, or the work it left running (an engine starting, so that an unload or a
        newer task need not wait behind it): the task's message is acknowledged when that
        work ends, kept alive until then, and delivered again if it is cancelled (the worker
        stopped) or fails (``libs/runtime/acks.py``)."""

    @abstractmethod
    async def on_generate(self, request: GenerationRequest, delivery: Delivery) -> None:
        """A new request for a deployment whose first shard runs here."""

    @abstractmethod
    async def on_cancel(self, cancel: GenerationCancel, delivery: Delivery) -> None:
        """Drop a request."""

    @abstractmethod
    async def on_hidden(self, delivery: Delivery) -> None:
        """A binary hidden-state frame sent to this device (the torch ring's; an engine that
        runs no torch shard refuses it with ``refuse``)."""

    @abstractmethod
    async def expire(self, idle_s: float) -> None:
        """Drop work that has waited too long (called every few seconds)."""

    @abstractmethod
    async def tick(self) -> None:
        """Readings the engine takes once per telemetry interval (the vLLM one reads NVML)."""

    @abstractmethod
    async def preload(self) -> None:
        """Before any work, when the worker is told to (``TESSERA_WORKER_PRELOAD``): measure
        this device on the model, and hold what it can, so moved work starts at once."""

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine (``open_engine``), then take this device's shard tasks (a durable
        consumer: tasks sent while the process was away arrive when it is back), new requests,
        cancels and hidden-state frames. Where the task stream is not there yet, this creates it
        or, where this device's user may not, waits for the scheduler to, saying so
        (``keep_consumer``)."""
        await self.open_engine()
        me = self.device_id
        self._subs = [
            await self.bus.consume(
                SHARD_TASK,
                self._on_task,
                durable=work_consumer(me),
                subject=SHARD_TASK.subject(device_id=me),
                rejected=self.on_rejected,
                redelivery=self.redelivery,
            ),
            await self.bus.subscribe(
                GENERATION,
                self._on_generate,
                subject=GENERATION.pattern(device_id=me),
                rejected=self.on_rejected,
            ),
            await self.bus.subscribe(CANCEL, self.on_cancel, rejected=self.on_rejected),
            await self.bus.subscribe_bytes(HIDDEN.pattern(device_id=me), self.on_hidden),
        ]

    async def leave(
        self, timeout_s: float = 20.0, connected: Callable[[], bool] = lambda: True
    ) -> bool:
        """Say this device leaves, and serve on until the scheduler has moved its shards
        (their unload tasks arrive here), ``timeout_s`` passes or the cluster is out of reach
        (``connected`` false: nobody would move them); True once they moved."""
        message = DeviceLeaving(device_id=self.device_id, ts=self.clock(), reason="leaving")
        await self.bus.publish(DEVICE_LEAVING, message, device_id=self.device_id)
        started, deadline = time.monotonic(), time.monotonic() + timeout_s
        while self.device.work and time.monotonic() < deadline and connected():
            await asyncio.sleep(0.1)
        moved = not self.device.work
        log.info(
            "left" if moved else "left before its shards moved",
            extra={"device_id": self.device_id, "waited_s": round(time.monotonic() - started, 2)},
        )
        return moved

    async def close(self) -> None:
        """Take no more messages, end the loading reports, then stop the engine."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for key in list(self.loading):
            self._loaded(key)
        await self.close_engine()

    async def _on_generate(self, request: GenerationRequest, delivery: Delivery) -> None:
        if delivery.reply:
            await self.bus.publish_bytes(delivery.reply, b"")  # taken: the owner stops asking
        await self.on_generate(request, delivery)

    async def _on_task(self, task: ShardTask, delivery: Received) -> None:
        if task.device_id != self.device_id:
            return
        epoch, sent = self.unloaded.get(task.deployment_id, (-1, 0.0))
        if task.action == "unload":
            self.unloaded[task.deployment_id] = max((epoch, sent), (task.epoch, task.ts))
        elif task.epoch <= epoch and task.ts <= sent:
            # A load delivered again after its unload (cut short by a restart, its unload
            # came first): that plan is gone, loading it would hold work nobody routes to.
            log.info(
                "stale load dropped",
                extra={"deployment_id": task.deployment_id, "epoch": task.epoch},
            )
            return
        work = await self.on_task(task)
        if work is not None:
            delivery.settle_after(work)

    def on_rejected(self, channel: str, reason: str, detail: str) -> None:
        """A message that broke its contract: counted by channel and reason (the bus logs it,
        rate-limited)."""
        self.metrics.rejected.labels(channel, reason).inc()

    def refuse(self, channel: str, exc: ContractError) -> None:
        """``on_rejected`` for what arrives outside the bus's decoding (hidden-state frames)."""
        self.on_rejected(channel, exc.reason, exc.detail)
        _refusals.warning((channel, exc.reason), "rejected message", detail=exc.detail[:300])

    # -- replies -------------------------------------------------------------------------------
    async def status(
        self,
        task: ShardTask,
        state: str,
        reason: str | None = None,
        load_s: float = 0.0,
        progress: float | None = None,
    ) -> None:
        """Answer ``task``: ``state`` with ``reason`` (refused, failed). Any other state than
        ``loading`` ends the shard's loading reports; ``loaded`` reports progress 1."""
        if state != "loading":
            self._loaded((task.deployment_id, task.shard_index, task.epoch))
        if state == "loaded":
            progress = 1.0
            if load_s > 0:
                self.expected_load_s = load_s
        status = ShardStatus(
            deployment_id=task.deployment_id,
            device_id=self.device_id,
            shard_index=task.shard_index,
            epoch=task.epoch,
            state=state,
            engine=self.device.engines[0] if self.device.engines else "torch",
            reason=reason,
            progress=progress,
            load_s=load_s,
            ts=self.clock(),
        )
        await self.bus.publish(SHARD_STATUS, status, device_id=self.device_id)

    async def begin_loading(self, task: ShardTask) -> None:
        """Report ``task``'s shard ``loading`` now and every ``PROGRESS_EVERY_S`` until its
        final status. Progress is the share of the expected load time (the last load this
        worker measured) gone by, at most ``PROGRESS_CAP``: the engines do not say how far
        they are, only when they are done."""
        key = (task.deployment_id, task.shard_index, task.epoch)
        self._loaded(key)
        loading = self.loading[key] = Loading(task, time.monotonic())
        await self.status(task, "loading", progress=0.0)
        loading.reporter = asyncio.create_task(self._report(key, loading))

    def weights_connection(self) -> Any:
        """The NATS connection the weights come over (None on an in-memory bus)."""
        return getattr(self.bus, "nc", None)

    def weights_progress(self, task: ShardTask) -> Callable[[int, int], None]:
        """A ``progress(bytes_done, bytes_total)`` for ``task``'s weights as they arrive: each
        call that moved ``WEIGHTS_STEP`` of the total or came ``WEIGHTS_EVERY_S`` after the
        last one sent, and the last, is published on ``WEIGHTS_PROGRESS`` (the event feed).
        It may be called from another thread than the event loop's."""
        loop = asyncio.get_running_loop()
        sent = [-1.0, 0.0]  # the share and the moment (monotonic) last published
        model = task.card.name if task.card is not None else task.model

        async def send(done: int, total: int) -> None:
            message = WeightsProgress(
                device_id=self.device_id,
                model=model,
                deployment_id=task.deployment_id,
                shard_index=task.shard_index,
                bytes_done=done,
                bytes_total=total,
                ts=self.clock(),
            )
            try:
                await self.bus.publish(WEIGHTS_PROGRESS, message, device_id=self.device_id)
            except Exception:  # the next step (or the load's status) tells the rest
                log.warning("could not report weights progress", exc_info=True)

        def progress(done: int, total: int) -> None:
            share, now = (done / total if total else 1.0), time.monotonic()
            if share < 1.0 and share - sent[0] < WEIGHTS_STEP and now - sent[1] < WEIGHTS_EVERY_S:
                return
            sent[:] = [share, now]
            done = min(done, total)
            loop.call_soon_threadsafe(lambda: self._keep(loop.create_task(send(done, total))))

        return progress

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold a reference to a publish in flight until it ends."""
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def load_progress(self, loading: Loading) -> float:
        """The share of ``loading`` reported done: the expected load time gone by, at most
        ``PROGRESS_CAP``; for a shard in ``fetching``, the fetch's share as the first half and
        the engine's load as the second."""
        elapsed = time.monotonic() - loading.began
        engine = min(PROGRESS_CAP, elapsed / max(self.expected_load_s, 1e-3))
        task = loading.task
        key = (task.deployment_id, task.shard_index, task.epoch)
        if key not in self.fetching:
            return engine
        share = self.fetching[key]
        return 0.5 * (share if share is not None else 1.0 + engine)

    async def _report(self, key: tuple[str, int, int], loading: Loading) -> None:
        while self.loading.get(key) is loading:
            await asyncio.sleep(PROGRESS_EVERY_S)
            if self.loading.get(key) is not loading:
                return
            try:
                progress = round(self.load_progress(loading), 3)
                await self.status(loading.task, "loading", progress=progress)
            except Exception:  # a lost connection: the next report tries again
                log.warning("could not report loading", exc_info=True)

    def _loaded(self, key: tuple[str, int, int]) -> None:
        loading = self.loading.pop(key, None)
        if loading is not None and loading.reporter is not None:
            loading.reporter.cancel()

    async def emit(self, chunk: TokenChunk) -> None:
        if chunk.token_id is not None:
            self.token_times.append(time.monotonic())
            self.metrics.tokens.inc()
        await self.bus.publish(TOKENS, chunk, request_id=chunk.request_id, device_id=self.device_id)

    # -- measurements --------------------------------------------------------------------------
    def tokens_per_s(self) -> float | None:
        cutoff = time.monotonic() - RATE_WINDOW_S
        while self.token_times and self.token_times[0] < cutoff:
            self.token_times.popleft()
        return len(self.token_times) / RATE_WINDOW_S if self.token_times else None


def failure(request: GenerationRequest, message: str) -> TokenChunk:
    """The final chunk of a request this worker cannot run."""
    index = len(request.generated_token_ids)
    return TokenChunk.failure(request.request_id, index, request.epoch, message, time.time())
