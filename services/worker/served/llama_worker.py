"""The llamacpp worker: Tessera's placement, run by llama.cpp across devices.

Every llamacpp worker lends its device through a ``ggml-rpc-server`` for as long as it runs and
announces where (``rpc_endpoint``); the scheduler puts every device's address into a
placement's shard tasks. The first shard's worker runs ``llama-server`` with its own layers on
its CPU and each other shard's layers on that device's RPC server (``LlamaServer``); the other
shards' workers only take their task (their RPC server does the work). A device lost from the
route takes the head's server down with it; the scheduler's new placement arrives as tasks of a
newer epoch, the head starts its server on the new route, and the owner re-sends its requests.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from libs.agents.emulated_fleet import shard_intensity, work_key
from libs.contracts import Sampling, ShardTask, shard_ring
from libs.contracts.models import ModelCard
from libs.core.catalogue import GB
from libs.devices.emulated import EmulatedDevice
from libs.models.engine_support import llama_build, unserved_reason
from libs.models.shipped import MODEL_NAME, gguf_path, shipped_card
from libs.runtime.bus import Bus
from libs.weights.local_files import cached_path
from libs.weights.object_store import WeightsError
from libs.weights.whole_files import ensure_local
from services.worker.device.gpu import read_gpu
from services.worker.device.processes import EngineError
from services.worker.rpc.server import RpcServer
from services.worker.served.llama_server import GPU_SHARE, LlamaServer
from services.worker.served.server import EngineServer
from services.worker.served.worker import ServedWorker
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)
#: How long a measurement of this device is taken again without measuring: a host's speed
#: does not change within a day, and a worker that crashed and was started again by its
#: supervisor (or a cluster started again after a reboot) is back the sooner.
MEASURE_KEPT_S = 24 * 3600.0
#: The shipped model's layers (``shipped_card().layers``), for servers of it built by hand.
LAYERS = 30


class LlamaWorker(ServedWorker):
    def __init__(
        self,
        bus: Bus,
        device: EmulatedDevice,
        make_server: Callable[[ShardTask], EngineServer],
        rpc: RpcServer,
        measured_file: Path | None = None,
        **options: Any,
    ) -> None:
        """``options``: ``ServedWorker``'s (max_active, park_s, start_s, metrics, clock).
        ``measured_file``: where ``preload`` keeps its measurement for a restart soon after."""
        super().__init__(bus, device, make_server, **{"start_s": 120.0, **options})
        self.rpc = rpc
        self.measured_file = measured_file
        #: Shards of other heads' placements that this device's RPC server runs.
        self.lent: dict[str, ShardTask] = {}

    async def hold_weights(self, task: ShardTask) -> None:
        """The head of a placement holds its model's file first (``ensure_local``: its own,
        or fetched from the cluster's object store, reported as the first half of loading);
        only the head reads the file: the other devices get their layers through RPC."""
        card = task.card
        if card is None or task.shard_index != 0:
            return
        key = (task.deployment_id, task.shard_index, task.epoch)
        await self.begin_loading(task)
        self.fetching[key] = 0.0

        report = self.weights_progress(task)

        def fetched(done: int, total: int) -> None:
            self.fetching[key] = done / max(total, 1)
            report(done, total)

        try:
            await ensure_local(self.weights_connection(), card, fetched, device_id=self.device_id)
        except WeightsError as exc:
            raise EngineError(str(exc)) from exc
        self.fetching[key] = None

    async def open_engine(self) -> None:
        """This device's RPC server, lent to placements' heads for as long as the worker
        runs, and its address announced."""
        await self.rpc.start()
        self.device.rpc_endpoint = self.rpc.endpoint

    async def close_engine(self) -> None:
        await self.stop_serving()
        await self.rpc.stop()

    async def tick(self) -> None:
        """Nothing read per interval: the device's readings are its host's (the agent's)."""

    async def preload(self, new_tokens: int = 16) -> None:
        """Measure this device on the model before any work: the whole model's greedy decode
        for ``new_tokens`` (2 FLOPs per parameter per token), as the torch worker's warm-up
        measures its steps, so the scorer checks the announced speed from the first report."""
        kept = self.kept_measure()
        if kept is not None:  # a worker started again: the host has not changed meanwhile
            self.device.measured_gflops = kept
            log.info("measured", extra={"gflops": round(kept, 2), "kept_from_last_start": True})
            return
        server = self.make_server(whole_task("measure", self.device_id))
        try:
            await server.start(self.start_s)
            prompt, sampling = list(range(1, 25)), Sampling(max_tokens=new_tokens)
            times = [
                time.perf_counter() async for _ in server.complete(prompt, sampling, new_tokens)
            ]
        except (EngineError, httpx.HTTPError) as exc:
            log.warning("could not measure this device", extra={"reason": str(exc)[:300]})
            return
        finally:
            await server.stop()
        if len(times) > 2 and times[-1] > times[1]:  # decode steps after the first token
            flops = 2.0 * shipped_card().params * (len(times) - 2)
            self.device.measured_gflops = flops / (times[-1] - times[1]) / 1e9
            log.info("measured", extra={"gflops": round(self.device.measured_gflops, 2)})
            if self.measured_file is not None:
                self.measured_file.parent.mkdir(parents=True, exist_ok=True)
                self.measured_file.write_text(json.dumps(self.device.measured_gflops))

    def kept_measure(self) -> float | None:
        """The measurement of a start less than ``MEASURE_KEPT_S`` ago, if any."""
        path = self.measured_file
        try:
            if path is None or time.time() - path.stat().st_mtime > MEASURE_KEPT_S:
                return None
            return float(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def refusal(self, task: ShardTask) -> str | None:
        """Why this worker cannot take ``task``: a model llama.cpp does not run, or (on the
        head, which loads the file) a file this host does not hold."""
        if task.card is None:
            if task.model != MODEL_NAME:
                return f"{self.device_id}: the task for {task.model} carries no model card"
        else:
            unserved = unserved_reason("llamacpp", task.card)
            if unserved is not None:
                return f"{self.device_id}: {unserved}"
            if (
                task.shard_index == 0
                and local_file(task.card) is None
                and self.weights_connection() is None
            ):
                return (
                    f"{self.device_id}: {task.card.name}'s file is not on this host "
                    f"({task.card.source} on {task.card.origin_host})"
                )
        if task.shard_count > 1 and not task.endpoints:
            return (
                f"a device of {', '.join(task.route)} runs no llamacpp worker: llama.cpp "
                "splits a model only across llama.cpp RPC servers"
            )
        return None

    def lending_refusal(self, task: ShardTask) -> str | None:
        """llama.cpp's RPC server serves one client at a time: a second head would wait for
        the first to let go. So this device lends its layers to one deployment at a time
        (it may head others meanwhile)."""
        others = sorted(set(self.lent) - {task.deployment_id})
        if not others:
            return None
        return (
            f"{self.device_id}'s llama.cpp RPC server serves one head at a time, and it runs "
            f"layers of {others[0]} now"
        )

    def lent_tasks(self) -> Iterable[ShardTask]:
        """The layers this device's RPC server runs for other devices' heads."""
        return self.lent.values()

    def same_server(self, current: ShardTask, task: ShardTask) -> bool:
        return (current.spans, current.endpoints) == (task.spans, task.endpoints)

    async def on_lent_task(self, task: ShardTask) -> bool:
        """A task of a shard other than the first: its layers run on this device's RPC
        server, which only the placement's head may reach from now on (until its unload)."""
        if task.shard_index == 0:
            return False
        current = self.lent.get(task.deployment_id)
        if task.action == "unload":
            if current is not None and current.epoch <= task.epoch:
                self.device.unassign(work_key(current))
                del self.lent[task.deployment_id]
                await self.rpc.lend_to(lent.route[0] for lent in self.lent.values())
                await self.status(task, "unloaded")
            return True
        if current is not None and current.epoch >= task.epoch:
            if current.epoch == task.epoch:
                await self.status(task, "loaded")  # a repeat: its first answer may be lost
            return True
        reason = self.refusal(task) or self.lending_refusal(task) or self.no_room(task)
        if reason is not None:
            await self.status(task, "refused", reason)
            return True
        if current is not None:
            self.device.unassign(work_key(current))
        self.lent[task.deployment_id] = task
        self.device.assign(work_key(task), shard_intensity(task))
        await self.rpc.lend_to(lent.route[0] for lent in self.lent.values())  # only its heads
        await self.status(task, "loaded")  # the head's llama-server loads our layers
        return True


def whole_task(deployment_id: str, device_id: str) -> ShardTask:
    """The task of the shipped model whole on one device (a server started outside a
    placement: the worker's measurement, the benchmark's direct server)."""
    card = shipped_card()
    shards = [(device_id, 0, card.layers)]
    [task] = shard_ring("load", deployment_id, MODEL_NAME, shards, 0, 0.0, card=card)
    return task


def local_file(card: ModelCard) -> Path | None:
    """The model's file on this host: its source path, where it lies here with the size the
    card gives (the weights' transport, ``libs/weights/whole_files.ensure_local``, extends this
    to files received from the cluster)."""
    for path in (Path(card.source).expanduser(), cached_path(card.sha256)):
        try:
            if path.is_file() and path.stat().st_size == card.size_bytes:
                return path
        except OSError:
            continue
    return None


def vram_gb(settings: WorkerSettings) -> float | None:
    """The GPU memory this device announces for the layers placements give it (``GPU_SHARE``
    of GPU 0's, NVML's reading), where this device is its host (a joined host: ``tessera up``'s
    emulated devices share the host, whose GPU its vLLM worker serves) and ``make llama`` built
    llama.cpp with CUDA (its stamp's third field); else None: it serves from host memory."""
    build = llama_build(settings.llama_bin)
    reading = read_gpu() if settings.host_device and build and build[1] == "cuda" else None
    return None if reading is None else round(GPU_SHARE * reading.memory_total_bytes / GB, 3)


def server_factory(settings: WorkerSettings) -> Callable[[ShardTask], EngineServer]:
    """llama-server for a task, on its model's GGUF (the card's file; the shipped one for a
    task without a card), as ``settings`` configure it (the worker's, and the benchmark's
    direct server: the same flags)."""

    def make(task: ShardTask) -> LlamaServer:
        card = task.card or shipped_card()
        gguf = local_file(card) if task.card is not None else gguf_path()
        if gguf is None:
            raise EngineError(f"{card.name}'s file is not on this host ({card.source})")
        return LlamaServer(
            settings.llama_bin,
            gguf,
            task,
            card.layers,
            threads=settings.llama_thread_count,
            slots=settings.llama_slots,
            context=settings.llama_context,
            credentials=settings.rpc_credentials,
        )

    return make
