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
from services.worker.engine_server import EngineServer
from services.worker.gpu import read_gpu
from services.worker.served import ServedWorker
from services.worker.vllm_server import VllmServer


class VllmWorker(ServedWorker):
    def refusal(self, task: ShardTask) -> str | None:
        if task.shard_count == 1:
            return None
        return (
            f"{self.device_id} runs vLLM, which serves whole models: shard "
            f"{task.shard_index + 1} of {task.shard_count} belongs on a torch worker"
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
