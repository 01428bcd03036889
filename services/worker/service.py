"""The CPU shard worker: loads the shards the scheduler sends it and runs them over NATS.

One process stands in for one device. It listens on its device's subjects, through the ``Bus``:

- ``SHARD_TASK`` (a durable consumer): load or unload a shard; answers on ``SHARD_STATUS``.
- ``GENERATION``: a new request, when this device holds a deployment's first shard.
- ``HIDDEN``: binary frames from the previous shard (or sampled tokens from the last).
- ``CANCEL``: drop a request everywhere.

Work for a shard that is still loading (a newer epoch) is parked, not lost; work for an older
epoch is dropped. Compute runs on one thread: each step takes everything that arrived since
the last and runs all of a shard's active requests as one batch (continuous batching, see
engine.py). A slower emulated class sleeps in proportion to each step's compute. The device's
telemetry (announce, samples, heartbeats) comes from the same process, so killing the worker
is a device failure the scheduler sees.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from libs.agents.fleet import shard_intensity, work_key
from libs.contracts import (
    CANCEL,
    HIDDEN,
    ContractError,
    Frame,
    GenerationCancel,
    GenerationRequest,
    ShardTask,
    StepRow,
    decode_frame,
    step_rows,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shard import DEFAULT_PRECISION, ShardModel, shard_bytes
from libs.runtime.bus import Bus, Delivery, Unsubscribe
from libs.runtime.tracing import TRACEPARENT, carried, step
from services.worker.actions import Action, Emit
from services.worker.base import DeviceWorker, failure
from services.worker.engine import ShardEngine
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Share of a device's memory a shard may use (the rest: OS, KV caches, activations).
MEMORY_SHARE = 0.8
#: Layer ranges kept loaded (the current shard and standbys).
MODELS_KEPT = 2
#: Steps the measured speed is averaged over.
STEPS_KEPT = 64


@dataclass(frozen=True)
class Item:
    """One step of work for a deployment's shard at one epoch."""

    deployment_id: str
    epoch: int
    request: GenerationRequest | None = None
    frame: Frame | None = None
    rows: list[StepRow] = dataclasses.field(default_factory=list)  #: the frame's
    parked_at: float = 0.0
    #: The trace context it came with (a new request, a prefill frame); None when untraced.
    headers: dict[str, str] | None = None


class Worker(DeviceWorker):
    """The torch engine: layer shards of the prepared model in ``folder``."""

    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        folder: Path,
        *,
        precision: str = DEFAULT_PRECISION,
        max_active: int = 16,
        park_s: float = 60.0,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.time,
        compute: ThreadPoolExecutor | None = None,
    ) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        super().__init__(bus, device, metrics, clock)
        self.folder = folder
        self.precision = precision
        self.max_active = max_active
        self.park_s = park_s
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.stop_ids = frozenset(int(e) for e in eos_ids if e is not None)
        self.engines: dict[str, ShardEngine] = {}
        self.models: dict[tuple[int, int, str], ShardModel] = {}  #: (start, end, precision)
        self.parked: list[Item] = []
        self.cancelled: dict[str, float] = {}
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        #: The trace context of a traced request's first item, until its step runs.
        self.traced: dict[str, dict[str, str]] = {}
        self._task: asyncio.Task[None] | None = None
        #: Every torch call (loading, warm-up, steps) runs on this one thread. Torch's OpenMP
        #: keeps a team of threads per calling thread; a second team (a model loaded on another
        #: thread) makes libgomp, seeing more threads than cores, stop spinning between parallel
        #: regions: steps at 2 threads ran 35 % slower, at 1 thread's speed (measured here).
        self.compute = compute or ThreadPoolExecutor(1, thread_name_prefix="torch")
        #: (floating-point operations, seconds) of the last steps: the speed this device
        #: measures, which the scorer trusts over what it announced.
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=STEPS_KEPT)

    # -- lifecycle --------------------------------------------------------------------------
    async def subscribe_more(self) -> list[Unsubscribe]:
        self._task = asyncio.create_task(self._run())
        subject = HIDDEN.pattern(device_id=self.device_id)
        return [await self.bus.subscribe_bytes(subject, self.on_hidden)]

    async def close(self) -> None:
        await super().close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.compute.shutdown(wait=False, cancel_futures=True)

    # -- shard tasks ------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> None:
        current = self.engines.get(task.deployment_id)
        if task.action == "unload":
            if current is not None and current.epoch <= task.epoch:
                del self.engines[task.deployment_id]
                self.device.unassign(work_key(task))
                self._update_gauges()
                await self.status(task, "unloaded")
            return
        if current is not None and current.epoch >= task.epoch:
            return  # a repeat, or older than what runs here
        started = time.monotonic()
        precision = task.precision or self.precision  # the deployment's, else this worker's
        try:
            need = await self._torch(
                shard_bytes, self.folder, task.layer_start, task.layer_end, precision
            )
            room = self.device.memory_limit_gb * MEMORY_SHARE * 1e9
            if need > room:
                reason = (
                    f"shard of {need / 1e9:.2f} GB does not fit {self.device.device_class} "
                    f"{self.device_id} ({room / 1e9:.2f} GB usable)"
                )
                log.warning("refused shard", extra={"reason": reason})
                await self.status(task, "refused", reason)
                return
            model = await self.model(task.layer_start, task.layer_end, precision)
        except Exception as exc:
            log.exception("shard load failed", extra={"deployment_id": task.deployment_id})
            await self.status(task, "failed", f"{type(exc).__name__}: {exc}")
            return
        route = task.route or (task.device_id,)
        self.engines[task.deployment_id] = ShardEngine(
            model, task, route, self.tokenizer, self.stop_ids, self.clock, self.max_active
        )
        self.device.assign(work_key(task), shard_intensity(task))
        self._update_gauges()
        load_s = time.monotonic() - started
        log.info(
            "loaded shard",
            extra={
                "deployment_id": task.deployment_id,
                "layers": [task.layer_start, task.layer_end],
                "precision": precision,
                "epoch": task.epoch,
                "load_s": round(load_s, 2),
            },
        )
        await self.status(task, "loaded", load_s=load_s)
        self._unpark(task.deployment_id)

    async def _torch(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on the torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, function, *args)

    async def model(self, start: int, end: int, precision: str | None = None) -> ShardModel:
        """The layers ``[start, end)`` in ``precision`` (default: this worker's), loaded once:
        a shard this worker held before (or the whole model it preloaded) is ready at once
        when the scheduler moves work here."""
        precision = precision or self.precision
        key = (start, end, precision)
        if key not in self.models:
            self.models[key] = await self._torch(ShardModel, self.folder, start, end, precision)
            while len(self.models) > MODELS_KEPT:
                self.models.pop(next(iter(self.models)))  # the least recently used
        self.models[key] = self.models.pop(key)  # most recently used last
        return self.models[key]

    async def preload(self) -> None:
        """Load the whole model now if it fits (a warm standby for a failed device's work)."""
        from transformers import AutoConfig

        layers = int(AutoConfig.from_pretrained(self.folder).num_hidden_layers)
        need = await self._torch(shard_bytes, self.folder, 0, layers, self.precision)
        if need <= self.device.memory_limit_gb * MEMORY_SHARE * 1e9:
            model = await self.model(0, layers)
            await self._torch(self._warm_up, model)
            log.info(
                "preloaded the whole model",
                extra={"layers": layers, "gflops": round(self.device.measured_gflops or 0, 2)},
            )

    def _warm_up(self, model: ShardModel) -> None:
        """Two short generations (a 24-token prompt, 8 tokens: a chat request's shape) on
        ``model``: the first warms it (real work then runs at full speed at once), the second
        measures the device's speed on its one-row decode steps before any real work does."""
        import torch

        for measure in (False, True):
            cache = model.new_cache()
            logits = model.forward(torch.arange(1, 25).unsqueeze(0), cache)
            for _ in range(8):
                before, started = model.flops, time.perf_counter()
                logits = model.forward(logits.argmax(-1, keepdim=True), cache)
                if measure:
                    self._measured(model.flops - before, time.perf_counter() - started)

    def _measured(self, flops: int, busy_s: float) -> None:
        """Record a step's work; the emulated class's slowdown counts as its time."""
        if flops > 0 and busy_s > 0:
            self.steps.append((flops, busy_s / self.device.speed_factor))
            total_s = sum(s for _, s in self.steps)
            self.device.measured_gflops = sum(f for f, _ in self.steps) / total_s / 1e9

    # -- incoming work ----------------------------------------------------------------------
    async def on_generate(self, request: GenerationRequest, delivery: Delivery) -> None:
        engine = self.engines.get(request.deployment_id)
        if engine is not None and engine.epoch == request.epoch:
            if not engine.first:
                log.warning("request sent to a shard that is not first", extra=_ids(request))
                return
            if engine.full:
                self.metrics.refused.inc()
                await self.emit(failure(request, engine.busy()))
                return
        self._accept(Item(request.deployment_id, request.epoch, request=request, headers=carried()))

    async def on_hidden(self, delivery: Delivery) -> None:
        try:
            frame = decode_frame(delivery.data)
            rows = step_rows(frame)
            deployment_id = HIDDEN.token_of(delivery.subject, "deployment_id")
        except ContractError as exc:
            self.refuse(HIDDEN.name, exc)
            return
        headers = dict(delivery.headers) if delivery.headers else None
        self._accept(Item(deployment_id, frame.epoch, frame=frame, rows=rows, headers=headers))

    async def on_cancel(self, cancel: GenerationCancel, delivery: Delivery) -> None:
        deployment_id = CANCEL.token_of(delivery.subject, "deployment_id")
        self.cancelled[cancel.request_id] = time.monotonic()
        engine = self.engines.get(deployment_id)
        if engine is not None and engine.cancel(cancel.request_id):
            log.info("cancelled", extra={"request_id": cancel.request_id})

    def _accept(self, item: Item) -> None:
        engine = self.engines.get(item.deployment_id)
        if engine is None or item.epoch > engine.epoch:
            self.parked.append(dataclasses.replace(item, parked_at=time.monotonic()))
        elif item.epoch == engine.epoch:
            self.queue.put_nowait(item)
        self._update_gauges()  # an older epoch's work is dropped: its owner re-runs it

    def _unpark(self, deployment_id: str) -> None:
        engine = self.engines[deployment_id]
        keep: list[Item] = []
        for item in self.parked:
            if item.deployment_id != deployment_id or item.epoch > engine.epoch:
                keep.append(item)
            elif item.epoch == engine.epoch:
                self.queue.put_nowait(item)
        self.parked = keep

    async def expire(self, idle_s: float) -> None:
        """Drop parked work nobody loaded a shard for, and requests whose END was lost."""
        now = time.monotonic()
        stale = [i for i in self.parked if now - i.parked_at > self.park_s]
        self.parked = [i for i in self.parked if now - i.parked_at <= self.park_s]
        for item in stale:
            if item.request is not None:
                await self.emit(
                    failure(item.request, f"no shard of {item.deployment_id} loaded on here")
                )
        for engine in self.engines.values():
            engine.expire(idle_s)
        self.cancelled = {r: t for r, t in self.cancelled.items() if now - t < idle_s}
        self._update_gauges()

    # -- the compute loop -------------------------------------------------------------------
    async def _run(self) -> None:
        """Take everything that arrived, then step each engine with work: all its requests in
        one batch. Whatever arrives during a step joins the next one."""
        while True:
            if not any(e.ready for e in self.engines.values()):
                await self._take(await self.queue.get())
            while not self.queue.empty():
                await self._take(self.queue.get_nowait())
            for deployment_id, engine in list(self.engines.items()):
                if engine.ready:
                    await self._step(deployment_id, engine)
            self._update_gauges()

    async def _take(self, item: Item) -> None:
        engine = self.engines.get(item.deployment_id)
        if engine is None or engine.epoch != item.epoch:
            return
        if item.headers and TRACEPARENT in item.headers:
            self.traced.setdefault(item.deployment_id, item.headers)
        if item.request is not None:
            if item.request.request_id not in self.cancelled:
                await self._dispatch(item.deployment_id, engine.admit(item.request))
        else:
            assert item.frame is not None
            engine.receive(item.frame, item.rows, self.cancelled)

    async def _step(self, deployment_id: str, engine: ShardEngine) -> None:
        task = engine.task
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": task.model,
            "tessera.device_id": self.device_id,
            "tessera.shard_index": task.shard_index,
            "tessera.layers": f"{task.layer_start}-{task.layer_end}",
        }
        # Traced: a step that runs a traced request's first rows (decode steps carry none).
        with step(
            f"shard {task.shard_index} step", self.traced.pop(deployment_id, None), **attributes
        ):
            started, flops = time.monotonic(), engine.model.flops
            actions = await self._torch(engine.step)
            busy = time.monotonic() - started
            self.metrics.step_seconds.observe(busy)
            if engine.rows == 1:  # like for like: one-row steps, as in the warm-up
                self._measured(engine.model.flops - flops, busy)
            if self.device.speed_factor < 1.0:  # emulate a slower device class
                await asyncio.sleep(busy * (1.0 / self.device.speed_factor - 1.0))
            await self._dispatch(deployment_id, actions)

    async def _dispatch(self, deployment_id: str, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Emit):
                await self.emit(action.chunk)
            elif action.device_id == self.device_id:
                rows = step_rows(action.frame)
                self._accept(Item(deployment_id, action.frame.epoch, frame=action.frame, rows=rows))
            else:
                subject = HIDDEN.subject(deployment_id=deployment_id, device_id=action.device_id)
                # Only a step with a request's first rows carries its trace on.
                headers = carried() if action.opens else None
                await self.bus.publish_bytes(subject, action.frame.encode(), headers)

    def _update_gauges(self) -> None:
        depth = self.queue.qsize() + len(self.parked)
        self.device.queue_depth = depth
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.queue_depth.set(depth)
        self.metrics.active.set(sum(len(e.live) for e in self.engines.values()))


def _ids(request: GenerationRequest) -> dict[str, object]:
    return {"request_id": request.request_id, "deployment_id": request.deployment_id}
