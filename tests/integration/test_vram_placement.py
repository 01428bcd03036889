"""A GPU host's llama.cpp worker, as the scheduler sees it (a real scorer and scheduler on a real
nats-server and redis-server): its VRAM is counted apart from its host memory, a model its host
memory cannot hold is placed with its layers in the VRAM, the shard task says how many, and the
next placement counts what the first holds there.

No GPU here: the device is a stand-in that announces and reports as a CUDA llama.cpp worker on
a GPU host does (``vram_gb`` in its announce, NVML's reading in each sample), and nothing loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import (
    ANNOUNCE,
    SHARD_TASK,
    TELEMETRY,
    DeviceAnnounce,
    DeviceClass,
    ShardTask,
)
from libs.contracts.device import GpuSample
from libs.contracts.keys import Keys
from libs.core.catalogue import card_spec
from libs.core.partition import gpu_part
from libs.models.registry import register_sync
from libs.models.shipped import MODEL_NAME, shipped_card
from libs.runtime.bus import publish, subscribe
from libs.runtime.procs import free_port
from tests.builders import make_capabilities, make_telemetry
from tests.integration.test_speed_check import settled
from tests.processes import ServiceProcess, service_env
from tests.waiting import wait_until, wait_until_async

CONTEXT = 2048
#: The stand-in's VRAM: SmolLM2 whole at a 2,048-token context takes 0.144 GB of it, so one
#: copy is held there whole and the next in what that leaves.
VRAM_GB = 0.2


@contextlib.asynccontextmanager
async def gpu_host(nc: NatsClient, device_id: str, host: dict[str, float]) -> AsyncIterator[None]:
    """The stand-in device: announced with ``VRAM_GB``, a sample every 0.5 s until the block
    ends with ``host["free"]`` GB of host memory available, its GPU with nothing in use."""
    announce = DeviceAnnounce(
        device_id=device_id,
        device_class=DeviceClass.WORKSTATION,
        capabilities=make_capabilities(memory_total_gb=32.0),
        emulated=False,
        interval_s=0.5,
        engines=("llamacpp",),
        rpc_endpoint="127.0.0.1:50052",
        slots=1,
        vram_gb=VRAM_GB,
        ts=time.time(),
    )
    await publish(nc, ANNOUNCE, announce, device_id=device_id)
    gpu = GpuSample(
        utilisation=0.0, memory_used_gb=0.0, memory_total_gb=24.0, power_w=60.0, temperature_c=40
    )

    async def beat() -> None:
        for seq in range(1, 100_000):
            sample = make_telemetry(
                device_id,
                seq=seq,
                ts=time.time(),
                memory_total_gb=32.0,
                memory_available_gb=host["free"],
                gpu=gpu,
            )
            await publish(nc, TELEMETRY, sample, device_id=device_id)
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()


async def test_a_model_larger_than_host_memory_goes_to_the_vram_and_the_next_counts_it(
    nc: NatsClient,
    redis: Redis,
    nats_server: NatsServer,
    redis_server: RedisServer,
    scorer: ServiceProcess,
    uid: str,
) -> None:
    device, port = f"{uid}-gpu", free_port()
    env = {**service_env(nats_server, redis_server, uid), "TESSERA_SCHEDULER_HTTP_PORT": str(port)}
    register_sync(redis_server.url, uid, shipped_card())
    spec = card_spec(shipped_card(), "llamacpp", slots=1)
    whole = spec.shard_gb(spec.layers, True, True, CONTEXT)
    tasks: list[ShardTask] = []

    async def took(task: ShardTask, msg: Msg) -> None:
        tasks.append(task)

    await subscribe(nc, SHARD_TASK, took, subject=SHARD_TASK.subject(device_id=device))
    # Host memory for the embeddings and the runtime, not the whole model (0.39 GB).
    host = {"free": 0.3}
    assert spec.shard_gb(0, True, True, CONTEXT) < host["free"] < whole
    async with gpu_host(nc, device, host):
        await settled(redis, Keys(uid), [device], 2)
        scheduler = ServiceProcess("scheduler", env).start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

                async def preview() -> dict[str, Any]:
                    asked = {"model": MODEL_NAME, "context_length": CONTEXT}
                    response = await client.get("/instance/previews", params=asked)
                    shown = response.json() if response.status_code == 200 else [{}]
                    return dict(shown[0])

                async def feasible() -> bool:
                    return bool((await preview()).get("feasible"))

                await wait_until_async(feasible, timeout_s=30)
                (shard,) = (await preview())["shards"]
                # Whole on the GPU: every layer and the output (llama.cpp's 31 of SmolLM2's 30).
                assert shard["gpu_layers"] == spec.layers + 1
                assert shard["memory_gb"] <= host["free"] and shard["vram_gb"] <= VRAM_GB
                asked = {"model": MODEL_NAME, "deployment_id": "d1", "context_length": CONTEXT}
                placed = await client.post("/placements", json=asked)
                assert placed.status_code == 201, placed.text
                (held,) = placed.json()["assignments"]
                assert (held["vram_gb"], held["gpu_layers"]) == (shard["vram_gb"], 31)
                await wait_until(lambda: tasks, timeout_s=10)
                assert tasks[0].gpu_layers == 31  # the worker is told what goes to its GPU
                # Room on the host for another copy: it goes to the VRAM the first left.
                host["free"] = 0.3 + whole
                await wait_until_async(feasible, timeout_s=30)
                (second,) = (await preview())["shards"]
                left = VRAM_GB - held["vram_gb"]
                expected = gpu_part(spec, 0, spec.layers, True, CONTEXT, left)[0]
                assert 0 < second["gpu_layers"] == expected < 31 and second["vram_gb"] <= left
        finally:
            assert scheduler.stop() == 0, scheduler.tail()
