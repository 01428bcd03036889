"""The vLLM worker: the shard-task contract, served by a vLLM engine for whole-model placements.

A ``load`` task of a one-shard placement starts (or keeps) a vLLM server for the model: a
Hugging Face folder of the registry where it lies on this host, or the shipped model's
converted folder. A task for one shard of several is refused with the reason (vLLM here runs
whole models; layer shards go to torch or llamacpp workers), as is a model vLLM's build does
not register. Requests stream as ``ServedWorker`` streams them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.contracts import DEFAULT_CONTEXT_TOKENS, ShardTask
from libs.models.engine_support import VLLM_DIR, is_vllm_cpu_build, unserved_reason, vllm_build
from services.worker.device.gpu import read_gpu
from services.worker.served.server import EngineServer
from services.worker.served.vllm_server import VllmServer
from services.worker.served.worker import ServedWorker


class VllmWorker(ServedWorker):
    def __init__(self, *args: Any, venv: Path | None = None, **options: Any) -> None:
        """``ServedWorker``'s arguments; ``venv``: vLLM's virtualenv, whose list of
        architectures this worker judges a model by (default ``make vllm``'s)."""
        super().__init__(*args, **options)
        self.venv = venv or VLLM_DIR

    def refusal(self, task: ShardTask) -> str | None:
        card = task.card
        if card is not None:
            unserved = unserved_reason("vllm", card, vllm_dir=self.venv)
            if unserved is not None:
                return f"{self.device_id}: {unserved}"
            if card.format == "hf" and not Path(card.source).is_dir():
                return (
                    f"{self.device_id}: {card.name}'s folder is on {card.origin_host} "
                    f"({card.source}): a Hugging Face folder is served on the host it lies on"
                )
        if task.shard_count > 1:
            return (
                f"{self.device_id} runs vLLM, which serves whole models: shard "
                f"{task.shard_index + 1} of {task.shard_count} belongs on a torch worker"
            )
        return None  # beside others, as its memory holds (``no_room``): a server each

    def same_server(self, current: ShardTask, task: ShardTask) -> bool:
        """A whole model's server serves every epoch of its deployment."""
        return True

    async def hold_weights(self, task: ShardTask) -> None:
        """Nothing to fetch: vLLM serves the prepared folder this host holds."""

    async def on_lent_task(self, task: ShardTask) -> bool:
        """vLLM lends no layers: every task is for a server of its own."""
        return False

    async def open_engine(self) -> None:
        """Nothing runs before the first task: its server starts with it."""

    async def close_engine(self) -> None:
        await self.stop_serving()

    async def preload(self) -> None:
        """Nothing measured ahead: the device's speed is its GPU's, as its class says."""

    async def tick(self) -> None:
        """NVML's power, temperature and memory, into the metrics and the device's telemetry."""
        reading = await asyncio.to_thread(read_gpu)
        if reading is None:
            return
        self.metrics.gpu_power.set(reading.power_w)
        self.metrics.gpu_temperature.set(reading.temperature_c)
        self.metrics.gpu_memory.set(reading.memory_used_bytes)
        self.device.temperature_c = reading.temperature_c


def vllm_runs_eager(asked: bool | None, python: Path) -> bool:
    """``--enforce-eager`` (no CUDA graphs) unless asked: on for vLLM's CPU build (``make
    vllm``'s stamp beside its virtualenv says ``vllm-cpu…``) and where no GPU answers NVML;
    off on a GPU with the GPU build, where CUDA graphs are faster."""
    if asked is not None:
        return asked
    return is_vllm_cpu_build(vllm_build(python.parent.parent)) or read_gpu() is None


def server_factory(
    python: Path,
    folder: Path,
    *,
    dtype: str,
    kv_cache_gb: int,
    eager: bool,
    context: int = DEFAULT_CONTEXT_TOKENS,
    gpu_gb: float | None = None,
) -> Callable[[ShardTask], EngineServer]:
    """``gpu_gb``: the GPU's memory where vLLM's GPU build serves from it (None: the CPU
    build, whose KV cache is ``kv_cache_gb``)."""

    def make(task: ShardTask) -> EngineServer:
        """The server of ``task``'s model: a Hugging Face folder's where it lies, else the
        shipped model's converted ``folder``; its context no longer than the model's own; on a
        GPU, its share of the GPU's memory the placement's (``gpu_share``)."""
        card = task.card
        model = Path(card.source) if card is not None and card.format == "hf" else folder
        longest = task.context_length or context
        if card is not None and card.context_train > 0:
            longest = min(longest, card.context_train)
        return VllmServer(
            python,
            model,
            task.deployment_id,
            dtype=dtype,
            kv_cache_gb=kv_cache_gb,
            eager=eager,
            max_model_len=longest,
            gpu_share=gpu_share(task.memory_gb, gpu_gb) if gpu_gb else None,
        )

    return make


#: What a vLLM server takes on a GPU beyond the weights and KV cache the placement counts
#: (CUDA's context, the activations of its profiling batch, CUDA graphs), GB.
GPU_EXTRA_GB = 1.5


def gpu_share(memory_gb: float, gpu_gb: float) -> float:
    """``--gpu-memory-utilization`` for a deployment the placement counted ``memory_gb`` for,
    on a GPU of ``gpu_gb``: that and ``GPU_EXTRA_GB``, between 5 % and 90 % of the GPU (the
    whole 90 % where the placement said nothing), so that servers of several deployments fit
    side by side."""
    if memory_gb <= 0:
        return 0.9
    return round(min(0.9, max(0.05, (memory_gb + GPU_EXTRA_GB) / gpu_gb)), 3)
