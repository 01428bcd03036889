"""The CPU shard worker: loads the shards the scheduler sends it and runs them over NATS.

One process stands in for one device. It listens on its device's subjects, through the ``Bus``:

- ``SHARD_TASK`` (a durable consumer): load or unload a shard; answers on ``SHARD_STATUS``.
  A load runs beside the consumer (its message kept until it ends), so an unload or a newer
  epoch of the same deployment is taken at once and supersedes it.
- ``GENERATION``: a new request, when this device holds a deployment's first shard.
- ``HIDDEN``: binary frames from the previous shard (or sampled tokens from the last).
- ``CANCEL``: drop a request everywhere.

Work for a shard that is still loading (a newer epoch) is parked, not lost; work for an older
epoch is dropped. Compute runs on one thread: each step takes everything that arrived since
the last and runs all of a shard's active requests as one batch (continuous batching, see
engine.py). A slower emulated class sleeps in proportion to each step's compute. The device's
telemetry (its announce and samples; a sample is its heartbeat) comes from the same process, so
killing the worker is a device failure the scheduler sees.
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

from libs.agents.emulated_fleet import shard_intensity, work_key
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
from libs.models.shipped import MODEL_NAME
from libs.runtime.bus import Bus, Delivery, Unsubscribe
from libs.runtime.tracing import TRACEPARENT, carried, step
from libs.weights.layer_ranges import fetch_layers
from services.worker.actions import Action, Emit
from services.worker.base import DeviceWorker, failure
from services.worker.engine import ShardEngine
from services.worker.metrics import WorkerMetrics
from services.worker.prompts import refusal

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
    #: The device a frame came from (None: this worker's own work): taken only when it is a
    #: device of the deployment's route at the frame's epoch.
    sender: str | None = None


@dataclass(frozen=True)
class Cancel:
    """Drop a request from a deployment's engine (queued: applied between steps)."""

    deployment_id: str
    request_id: str


@dataclass(frozen=True)
class Expire:
    """Drop the requests idle for ``idle_s`` from every engine (queued like ``Cancel``)."""

    idle_s: float


class Worker(DeviceWorker):
    """The torch engine: layer shards of the prepared model in ``folder``."""

    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        folder: Path,
        *,
        precision: str = DEFAULT_PRECISION,
        model: str = MODEL_NAME,
        max_active: int = 16,
        park_s: float = 60.0,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.time,
        compute: ThreadPoolExecutor | None = None,
    ) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        super().__init__(bus, device, metrics, clock)
        #: The model ``folder`` holds: a task for another one is refused.
        self.model_name = model
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
        #: Loads in flight (``_load``), by deployment: they run off the shard-task consumer's
        #: callback, so an unload or a newer task is taken while one runs.
        self.loads: dict[str, tuple[ShardTask, asyncio.Task[None]]] = {}
        self.parked: list[Item] = []
        self.cancelled: dict[str, float] = {}
        #: What the compute loop applies to the engines, in arrival order. An engine's state
        #: is changed only there, and on the torch thread: steps, cancels and expiries run on
        #: it, so a cancel never lands in the middle of a step.
        self.queue: asyncio.Queue[Item | Cancel | Expire] = asyncio.Queue()
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
        loads = [load for _, load in self.loads.values()]
        for load in loads:
            load.cancel()  # kept in `loads`: each sees it was not superseded (and re-raises)
        if loads:
            await asyncio.wait(loads)
        self.loads.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.compute.shutdown(wait=False, cancel_futures=True)

    # -- shard tasks ------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> asyncio.Task[None] | None:
        """Take a shard task at once. A load returns its work (``_load``), which runs off the
        consumer's callback, so an unload or a newer task of the same deployment arriving
        meanwhile is taken without waiting and supersedes it."""
        current = self.engines.get(task.deployment_id)
        if task.action == "unload":
            dropped = self._supersede(task.deployment_id, task.epoch)
            if current is not None and current.epoch <= task.epoch:
                del self.engines[task.deployment_id]
                self.device.unassign(work_key(task))
                self._update_gauges()
                dropped = True
            if dropped:
                await self.status(task, "unloaded")
            return None
        if current is not None and current.epoch >= task.epoch:
            if current.epoch == task.epoch:
                # A repeat of what serves here (a scheduler that took over re-sends the load
                # tasks of its plans): say so again, its first answer may have been lost.
                await self.status(task, "loaded")
            return None  # else older than what runs here
        pending = self.loads.get(task.deployment_id)
        if pending is not None and pending[0].epoch == task.epoch:
            return pending[1]  # the load in flight, delivered again: settled by how it ends
        if pending is not None and pending[0].epoch > task.epoch:
            return None  # older than the load in flight
        if task.model != self.model_name:
            reason = f"{self.device_id} has no weights of {task.model}: it serves {self.model_name}"
            log.warning("refused shard", extra={"reason": reason})
            await self.status(task, "refused", reason)
            return None
        self._supersede(task.deployment_id, task.epoch)
        load = asyncio.create_task(self._load(task))
        self.loads[task.deployment_id] = (task, load)
        return load

    def _supersede(self, deployment_id: str, epoch: int) -> bool:
        """Drop the load of ``deployment_id`` in flight if it is for ``epoch`` or an older one
        (True if there was one). It reports nothing; what it ran on the torch thread, which
        cannot be interrupted, ends there and its result is dropped."""
        pending = self.loads.get(deployment_id)
        if pending is None or pending[0].epoch > epoch:
            return False
        task, load = self.loads.pop(deployment_id)  # first: the load sees it was superseded
        self._loaded((task.deployment_id, task.shard_index, task.epoch))  # no more "loading"
        load.cancel()
        return True

    def _loading(self, task: ShardTask) -> bool:
        """Whether ``task``'s load is still the one in flight for its deployment."""
        pending = self.loads.get(task.deployment_id)
        return pending is not None and pending[0] is task

    async def _load(self, task: ShardTask) -> None:
        """Load ``task``'s shard, then run it and report it ``loaded`` (the device works from
        then on), or report it refused or failed. Returns once ``task`` is done with, or
        superseded (an unload or a newer task: that one reports, this one nothing); cancelled
        only when the worker closes, so that ``task`` is delivered again to its next process."""
        started = time.monotonic()
        precision = task.precision or self.precision  # the deployment's, else this worker's
        try:
            await self.begin_loading(task)
            loaded = await self._shard_model(task, precision)
        except asyncio.CancelledError:
            if self._loading(task):
                raise  # the worker closes: the task is not acknowledged
            return  # superseded
        except Exception as exc:
            if not self._loading(task):
                return
            del self.loads[task.deployment_id]
            log.exception("shard load failed", extra={"deployment_id": task.deployment_id})
            await self.status(task, "failed", f"{type(exc).__name__}: {exc}")
            return
        if not self._loading(task):
            return  # superseded as it ended: its result is dropped
        del self.loads[task.deployment_id]
        if isinstance(loaded, str):
            log.warning("refused shard", extra={"reason": loaded})
            await self.status(task, "refused", loaded)
            return
        route = task.route or (task.device_id,)
        self.engines[task.deployment_id] = ShardEngine(
            loaded, task, route, self.tokenizer, self.stop_ids, self.clock, self.max_active
        )
        # Only now the device works: a refused or failed shard leaves its power and load be.
        self.device.assign(work_key(task), shard_intensity(task))
        self._unpark(task.deployment_id)  # before the report: an unload may come meanwhile
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

    async def _shard_model(self, task: ShardTask, precision: str) -> ShardModel | str:
        """The model of ``task``'s shard in ``precision``, or why it does not fit this device."""
        need = await self._torch(
            shard_bytes, self.folder, task.layer_start, task.layer_end, precision
        )
        room = self.device.memory_limit_gb * MEMORY_SHARE * 1e9
        if need > room:
            return (
                f"shard of {need / 1e9:.2f} GB does not fit {self.device.device_class} "
                f"{self.device_id} ({room / 1e9:.2f} GB usable)"
            )
        source = await self._weights(task)
        return await self.model(task.layer_start, task.layer_end, precision, source)

    async def _weights(self, task: ShardTask) -> Path | None:
        """Where the shard's weights come from: None where this host holds the model's file
        (the prepared folder, converted from it, loads fastest); else the sparse GGUF of the
        shard's layer range, fetched from the cluster's object store (``libs/weights/layer_ranges``:
        only the header, its layers and the embedding or head), its progress on the feed."""
        card, connection = task.card, self.weights_connection()
        if card is None or connection is None:
            return None
        fetched = await fetch_layers(
            connection,
            card,
            task.layer_start,
            task.layer_end,
            card.layers,
            self.weights_progress(task),
        )
        return None if fetched.whole else fetched.path

    async def _torch(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on the torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, function, *args)

    async def model(
        self, start: int, end: int, precision: str | None = None, source: Path | None = None
    ) -> ShardModel:
        """The layers ``[start, end)`` in ``precision`` (default: this worker's), loaded once
        from ``source`` (default: the prepared folder; else a GGUF): a shard this worker held
        before (or the whole model it preloaded) is ready at once when the scheduler moves
        work here."""
        precision = precision or self.precision
        key = (start, end, precision)
        if key not in self.models:
            folder = source or self.folder
            self.models[key] = await self._torch(ShardModel, folder, start, end, precision)
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
        refused = refusal(request, "torch")
        if refused is not None:
            await self.emit(refused)
            return
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
            sender = HIDDEN.token_of(delivery.subject, "sender_id")
        except ContractError as exc:
            self.refuse(HIDDEN.name, exc)
            return
        headers = dict(delivery.headers) if delivery.headers else None
        item = Item(deployment_id, frame.epoch, frame=frame, rows=rows, headers=headers)
        self._accept(dataclasses.replace(item, sender=sender))

    async def on_cancel(self, cancel: GenerationCancel, delivery: Delivery) -> None:
        deployment_id = CANCEL.token_of(delivery.subject, "deployment_id")
        self.cancelled[cancel.request_id] = time.monotonic()
        if deployment_id in self.engines:
            self.queue.put_nowait(Cancel(deployment_id, cancel.request_id))

    def _accept(self, item: Item) -> None:
        engine = self.engines.get(item.deployment_id)
        if engine is None or item.epoch > engine.epoch:
            self.parked.append(dataclasses.replace(item, parked_at=time.monotonic()))
        elif item.epoch == engine.epoch and self._from_route(item, engine.route):
            self.queue.put_nowait(item)
        self._update_gauges()  # an older epoch's work is dropped: its owner re-runs it

    def _unpark(self, deployment_id: str) -> None:
        engine = self.engines[deployment_id]
        keep: list[Item] = []
        for item in self.parked:
            if item.deployment_id != deployment_id or item.epoch > engine.epoch:
                keep.append(item)
            elif item.epoch == engine.epoch and self._from_route(item, engine.route):
                self.queue.put_nowait(item)
        self.parked = keep

    def _from_route(self, item: Item, route: tuple[str, ...]) -> bool:
        """Whether a frame came from a device of the deployment's route (a device that serves
        nothing of it cannot write into its pipeline); this worker's own work always does."""
        if item.sender is None or item.sender in route:
            return True
        detail = f"a frame from {item.sender}, not a device of {item.deployment_id}"
        self.refuse(HIDDEN.name, ContractError("not_routed", detail))
        return False

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
        if self.engines:
            self.queue.put_nowait(Expire(idle_s))
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

    async def _take(self, item: Item | Cancel | Expire) -> None:
        if isinstance(item, Cancel | Expire):
            await self._control(item)
            return
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

    async def _control(self, item: Cancel | Expire) -> None:
        """A cancel or an expiry, applied on the torch thread between steps."""
        if isinstance(item, Cancel):
            engine = self.engines.get(item.deployment_id)
            if engine is not None and await self._torch(engine.cancel, item.request_id):
                log.info("cancelled", extra={"request_id": item.request_id})
            return
        for deployment_id, engine in list(self.engines.items()):
            for request_id in await self._torch(engine.expire, item.idle_s):
                log.warning(
                    "dropped an idle request (its end was lost)",
                    extra={"request_id": request_id, "deployment_id": deployment_id},
                )

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
                subject = HIDDEN.subject(
                    deployment_id=deployment_id,
                    device_id=action.device_id,
                    sender_id=self.device_id,
                )
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
