"""The torch ring's worker: layer shards of the prepared model, run in PyTorch on this host.

One process stands in for one device. Beside what every worker takes (``DeviceWorker``), it
loads and unloads shards as ``SHARD_TASK`` says: a load runs beside the consumer (its message
kept until it ends), so an unload or a newer epoch of the same deployment is taken at once and
supersedes it; the layers come from the prepared folder, or as the shard's own layers fetched
from the cluster's object store, and stay held for a later placement (``held.py``). New
requests (``GENERATION``, on a first shard), hidden-state frames (``HIDDEN``) and cancels wait
in the ``Inbox`` (parked while their shard loads, ``inbox.py``). Compute runs on one thread:
each step takes everything that arrived since the last and runs all of a shard's active
requests as one batch (continuous batching, ``shard_engine.py``). A slower emulated class
sleeps in proportion to each step's compute. The device's telemetry (its announce and samples;
a sample is its heartbeat) comes from the same process, so killing the worker is a device
failure the scheduler sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from libs.agents.emulated_fleet import shard_intensity, work_key
from libs.contracts import (
    CANCEL,
    HIDDEN,
    ContractError,
    GenerationCancel,
    GenerationRequest,
    ShardTask,
    decode_frame,
    step_rows,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME
from libs.runtime.bus import Bus, Delivery
from libs.runtime.cancelling import stopping
from libs.runtime.tracing import TRACEPARENT, carried, step
from services.worker.device.metrics import WorkerMetrics
from services.worker.device.prompts import refusal
from services.worker.device.worker import DeviceWorker, failure
from services.worker.torch.actions import Action, Emit
from services.worker.torch.held import HeldModels
from services.worker.torch.inbox import Cancel, Expire, Inbox, Item
from services.worker.torch.shard import DEFAULT_PRECISION
from services.worker.torch.shard_engine import ShardEngine

log = logging.getLogger(__name__)


class TorchWorker(DeviceWorker):
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
        """``compute``: the one thread of every torch call of this process (``held.py``)."""
        from transformers import AutoTokenizer, GenerationConfig

        super().__init__(bus, device, metrics, clock)
        #: The model ``folder`` holds: a task for another one is refused.
        self.model_name = model
        self.folder = folder
        self.precision = precision
        self.max_active = max_active
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.stop_ids = frozenset(int(e) for e in eos_ids if e is not None)
        self.engines: dict[str, ShardEngine] = {}
        self.held = HeldModels(folder, precision, device, compute)
        #: Loads in flight (``_load``), by deployment: they run off the shard-task consumer's
        #: callback, so an unload or a newer task is taken while one runs.
        self.loads: dict[str, tuple[ShardTask, asyncio.Task[None]]] = {}
        #: What the compute loop applies to the engines, in arrival order. An engine's state
        #: is changed only there, and on the torch thread: steps, cancels and expiries run on
        #: it, so a cancel never lands in the middle of a step.
        self.inbox = Inbox(park_s, self.refuse)
        #: The trace context of a traced request's first item, until its step runs.
        self.traced: dict[str, dict[str, str]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    async def open_engine(self) -> None:
        """The compute loop, waiting for the first work."""
        self._task = asyncio.create_task(self._run())

    async def close_engine(self) -> None:
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
        self.held.close()

    async def tick(self) -> None:
        """Nothing read per interval: the steps measure this device as they run."""

    async def preload(self) -> None:
        """Load the whole model now if it fits, and measure this device's speed on it."""
        await self.held.preload()

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
            loaded = await self.held.shard(
                task, precision, self.weights_connection(), self.weights_progress(task)
            )
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
        # Before the report: an unload may come meanwhile.
        self.inbox.unpark(task.deployment_id, self.engines[task.deployment_id])
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
        self.inbox.cancel(cancel.request_id)
        if deployment_id in self.engines:
            self.inbox.queue.put_nowait(Cancel(deployment_id, cancel.request_id))

    def _accept(self, item: Item) -> None:
        self.inbox.accept(item, self.engines.get(item.deployment_id))
        self._update_gauges()  # an older epoch's work is dropped: its owner re-runs it

    async def expire(self, idle_s: float) -> None:
        """Drop parked work nobody loaded a shard for, and requests whose END was lost."""
        for item in self.inbox.expire(idle_s):
            if item.request is not None:
                await self.emit(
                    failure(item.request, f"no shard of {item.deployment_id} loaded on here")
                )
        if self.engines:
            self.inbox.queue.put_nowait(Expire(idle_s))
        self._update_gauges()

    # -- the compute loop -------------------------------------------------------------------
    async def _run(self) -> None:
        """Take everything that arrived, then step each engine with work: all its requests in
        one batch. Whatever arrives during a step joins the next one."""
        while not stopping():
            if not any(e.ready for e in self.engines.values()):
                await self._take(await self.inbox.queue.get())
            while not self.inbox.queue.empty():
                await self._take(self.inbox.queue.get_nowait())
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
            if item.request.request_id not in self.inbox.cancelled:
                await self._dispatch(item.deployment_id, engine.admit(item.request))
        else:
            assert item.frame is not None
            engine.receive(item.frame, item.rows, self.inbox.cancelled)

    async def _control(self, item: Cancel | Expire) -> None:
        """A cancel or an expiry, applied on the torch thread between steps."""
        if isinstance(item, Cancel):
            engine = self.engines.get(item.deployment_id)
            if engine is not None and await self.held.run(engine.cancel, item.request_id):
                log.info("cancelled", extra={"request_id": item.request_id})
            return
        for deployment_id, engine in list(self.engines.items()):
            for request_id in await self.held.run(engine.expire, item.idle_s):
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
            actions = await self.held.run(engine.step)
            busy = time.monotonic() - started
            self.metrics.step_seconds.observe(busy)
            if engine.rows == 1:  # like for like: one-row steps, as in the warm-up
                self.held.measured(engine.model.flops - flops, busy)
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
        depth = self.inbox.depth
        self.device.queue_depth = depth
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.queue_depth.set(depth)
        self.metrics.active.set(sum(len(e.live) for e in self.engines.values()))


def _ids(request: GenerationRequest) -> dict[str, object]:
    return {"request_id": request.request_id, "deployment_id": request.deployment_id}
