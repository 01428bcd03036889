"""The vLLM worker: the shard-task contract, served by a vLLM engine for whole-model placements.

A ``load`` task of a one-shard placement starts (or keeps) a vLLM server for the model; a task
for one shard of several is refused with the reason (vLLM here runs whole models; layer shards
go to torch workers). Each request streams from vLLM token by token into ``TokenChunk``s, from
index ``len(generated_token_ids)`` on, so a request re-run after a migration continues where the
user's stream stopped. Requests of every epoch wait while the server starts (up to ``park_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from libs.agents.fleet import shard_intensity, work_key
from libs.contracts import GenerationCancel, GenerationRequest, ShardTask, TokenChunk
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus, Delivery
from services.worker.base import DeviceWorker, failure
from services.worker.gpu import read_gpu
from services.worker.metrics import WorkerMetrics
from services.worker.vllm_server import VllmError, VllmServer

log = logging.getLogger(__name__)

FINISH = {"stop": "stop", "length": "length"}


class VllmWorker(DeviceWorker):
    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        make_server: Callable[[ShardTask], VllmServer],
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
        self.server: VllmServer | None = None
        self.ready = asyncio.Event()
        self.running: dict[str, asyncio.Task[None]] = {}

    async def close(self) -> None:
        await super().close()
        for job in list(self.running.values()):
            job.cancel()
        await self._stop_server()

    # -- shard tasks ---------------------------------------------------------------------------
    async def on_task(self, task: ShardTask) -> None:
        current = self.task
        same = current is not None and current.deployment_id == task.deployment_id
        if task.action == "unload":
            if same and current is not None and current.epoch <= task.epoch:
                await self._stop_server()
                self.device.unassign(work_key(current))
                self.task = None
                await self.status(task, "unloaded")
            return
        if same and current is not None and current.epoch >= task.epoch:
            return  # a repeat, or older than what runs here
        if task.shard_count != 1:
            reason = (
                f"{self.device_id} runs vLLM, which serves whole models: shard "
                f"{task.shard_index + 1} of {task.shard_count} belongs on a torch worker"
            )
            await self.status(task, "refused", reason)
            return
        if current is not None and not same:
            reason = f"{self.device_id} already serves {current.deployment_id} with vLLM"
            await self.status(task, "refused", reason)
            return
        self.task = task  # requests of this epoch wait for `ready` from now on
        self.device.assign(work_key(task), shard_intensity(task))
        if self.server is not None and self.ready.is_set():
            await self.status(task, "loaded")  # the same model, moved to a newer epoch
            return
        self.server = self.make_server(task)
        try:
            load_s = await self.server.start(self.start_s)
        except VllmError as exc:
            log.error("vllm failed to start", extra={"reason": str(exc)})
            await self._stop_server()
            self.device.unassign(work_key(task))
            self.task = None
            await self.status(task, "failed", str(exc)[:2000])
            return
        self.ready.set()
        log.info("vllm serving", extra={"deployment_id": task.deployment_id, "load_s": load_s})
        await self.status(task, "loaded", load_s=load_s)

    async def _stop_server(self) -> None:
        self.ready.clear()
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
        try:
            await asyncio.wait_for(self.ready.wait(), self.park_s)
        except TimeoutError:
            await self.emit(failure(request, f"no vLLM engine for {request.deployment_id} here"))
            return
        task, server = self.task, self.server
        if task is None or server is None or task.deployment_id != request.deployment_id:
            await self.emit(failure(request, f"{request.deployment_id} is not served here"))
            return
        if request.epoch < task.epoch:
            return  # the owner re-runs it on the newer placement
        index = len(request.generated_token_ids)
        left = request.sampling.max_tokens - index
        prompt = [*request.prompt_token_ids, *request.generated_token_ids]
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
        try:
            if left > 0:
                async for piece in server.complete(prompt, request.sampling, left):
                    for i, token in enumerate(piece.token_ids):
                        text = piece.text if i == len(piece.token_ids) - 1 else ""
                        await self.emit(self._token(request, index, token, text))
                        index += 1
                    self._update_gauges()
                    if piece.finish_reason is not None:
                        reason = FINISH.get(piece.finish_reason, "error")
                        last = last.model_copy(update={"finish_reason": reason, "index": index})
            await self.emit(last.model_copy(update={"completion_tokens": index, "ts": time.time()}))
        except Exception as exc:  # vLLM refused it, or went away: the request fails, not the worker
            log.warning("vllm request failed", extra={"request_id": request.request_id})
            with contextlib.suppress(Exception):
                await self.emit(failure(request, f"{type(exc).__name__}: {exc}"))

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

    async def tick(self) -> None:
        """NVML's power, temperature and memory, into the metrics and the device's telemetry."""
        reading = await asyncio.to_thread(read_gpu)
        if reading is None:
            return
        self.metrics.gpu_power.set(reading.power_w)
        self.metrics.gpu_temperature.set(reading.temperature_c)
        self.metrics.gpu_memory.set(reading.memory_used_bytes)
        self.device.temperature_c = reading.temperature_c

    def _update_gauges(self) -> None:
        self.device.queue_depth = len(self.running)
        self.device.measured_tokens_per_s = self.tokens_per_s()
        self.metrics.active.set(len(self.running))
        self.metrics.queue_depth.set(0 if self.ready.is_set() else len(self.running))


def server_factory(
    python: Path, folder: Path, *, dtype: str, kv_cache_gb: int, eager: bool
) -> Callable[[ShardTask], VllmServer]:
    def make(task: ShardTask) -> VllmServer:
        return VllmServer(
            python, folder, task.deployment_id, dtype=dtype, kv_cache_gb=kv_cache_gb, eager=eager
        )

    return make
