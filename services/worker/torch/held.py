"""The layer ranges a torch worker holds loaded, the one thread every torch call runs on, and
the speed this device measures on them.

A shard this worker held before (or the whole model it preloaded) is ready at once when the
scheduler moves work here: the last ``MODELS_KEPT`` layer ranges stay loaded, the least
recently used dropped first. Every torch call of the worker (loading, warm-up, steps) runs on
one thread: torch's OpenMP keeps a team of threads per calling thread, and a second team (a
model loaded on another thread) makes libgomp, seeing more threads than cores, stop spinning
between parallel regions: steps at 2 threads ran 35 % slower, at 1 thread's speed (measured
here).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from libs.contracts import ShardTask
from libs.devices.emulated import EmulatedDevice
from libs.weights.layer_ranges import fetch_layers
from services.worker.torch.shard import ShardModel, shard_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Share of a device's memory a shard may use (the rest: OS, KV caches, activations).
MEMORY_SHARE = 0.8
#: Layer ranges kept loaded (the current shard and standbys).
MODELS_KEPT = 2
#: Steps the measured speed is averaged over.
STEPS_KEPT = 64


class HeldModels:
    """The layer ranges of the prepared model in ``folder`` loaded on ``device``, by (start,
    end, precision); ``precision`` is the worker's own, for a task that names none."""

    def __init__(
        self,
        folder: Path,
        precision: str,
        device: EmulatedDevice,
        compute: ThreadPoolExecutor | None = None,
    ) -> None:
        self.folder = folder
        self.precision = precision
        self.device = device
        #: Loaded layer ranges, the most recently used last.
        self.loaded: dict[tuple[int, int, str], ShardModel] = {}
        #: The one thread of every torch call (the module's docstring says why).
        self.compute = compute or ThreadPoolExecutor(1, thread_name_prefix="torch")
        #: (floating-point operations, seconds) of the last steps: the speed this device
        #: measures, which the scorer trusts over what it announced.
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=STEPS_KEPT)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on the torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, function, *args)

    async def refusal(self, start: int, end: int, precision: str) -> str | None:
        """Why the layers ``[start, end)`` in ``precision`` do not fit this device (None: they
        do): more bytes than ``MEMORY_SHARE`` of its memory."""
        need = await self.run(shard_bytes, self.folder, start, end, precision)
        room = self.device.memory_limit_gb * MEMORY_SHARE * 1e9
        if need <= room:
            return None
        return (
            f"shard of {need / 1e9:.2f} GB does not fit {self.device.device_class} "
            f"{self.device.device_id} ({room / 1e9:.2f} GB usable)"
        )

    async def shard(
        self,
        task: ShardTask,
        precision: str,
        connection: Any,
        progress: Callable[[int, int], None],
    ) -> ShardModel | str:
        """The model of ``task``'s shard in ``precision``, or why it does not fit this device.
        Its layers come from the prepared folder where this host holds the model's file (the
        folder, converted from it, loads fastest), else from the sparse GGUF of the shard's
        layer range, fetched over the NATS ``connection`` from the cluster's object store
        (``libs/models/ranges``: only the header, its layers and the embedding or head), with
        ``progress(bytes_done, bytes_total)`` as it arrives."""
        start, end = task.layer_start, task.layer_end
        refused = await self.refusal(start, end, precision)
        if refused is not None:
            return refused
        source: Path | None = None
        card = task.card
        if card is not None and connection is not None:
            fetched = await fetch_layers(connection, card, start, end, card.layers, progress)
            source = None if fetched.whole else fetched.path
        return await self.model(start, end, precision, source)

    async def model(
        self, start: int, end: int, precision: str | None = None, source: Path | None = None
    ) -> ShardModel:
        """The layers ``[start, end)`` in ``precision`` (default: the worker's), loaded once
        from ``source`` (default: the prepared folder; else a GGUF)."""
        precision = precision or self.precision
        key = (start, end, precision)
        if key not in self.loaded:
            folder = source or self.folder
            self.loaded[key] = await self.run(ShardModel, folder, start, end, precision)
            while len(self.loaded) > MODELS_KEPT:
                self.loaded.pop(next(iter(self.loaded)))  # the least recently used
        self.loaded[key] = self.loaded.pop(key)  # most recently used last
        return self.loaded[key]

    async def preload(self) -> None:
        """Load the whole model now if it fits (a warm standby for a failed device's work)."""
        from transformers import AutoConfig

        layers = int(AutoConfig.from_pretrained(self.folder).num_hidden_layers)
        if await self.refusal(0, layers, self.precision) is None:
            model = await self.model(0, layers)
            await self.run(self._warm_up, model)
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
                    self.measured(model.flops - before, time.perf_counter() - started)

    def measured(self, flops: int, busy_s: float) -> None:
        """Record a step's work; the emulated class's slowdown counts as its time."""
        if flops > 0 and busy_s > 0:
            self.steps.append((flops, busy_s / self.device.speed_factor))
            total_s = sum(s for _, s in self.steps)
            self.device.measured_gflops = sum(f for f, _ in self.steps) / total_s / 1e9

    def close(self) -> None:
        """Stop the torch thread (what runs there ends; what waits is dropped)."""
        self.compute.shutdown(wait=False, cancel_futures=True)
