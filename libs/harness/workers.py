"""Worker processes on this machine with a deployment placed across them by hand.

The scheduler normally sends the shard tasks; the pipeline tests and ``bench/pipeline.py``
send them directly, so they measure the workers and nothing else. ``even_split`` cuts the
layers into contiguous ranges, ``LocalWorkers`` starts ``python -m services.worker`` processes
(one per device), ``shard_tasks`` builds the tasks with the scheduler's own ring builder and
``place`` loads them and waits until every shard reports ``loaded``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Literal

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from libs.contracts import (
    GENERATION,
    SHARD_STATUS,
    SHARD_TASK,
    TOKENS,
    GenerationRequest,
    ShardStatus,
    ShardTask,
    TokenChunk,
    shard_ring,
)
from libs.runtime.bus import subscribe
from libs.runtime.nats_client import ensure_streams
from libs.runtime.procs import ServiceProcess
from libs.runtime.settings import child_env


def even_split(layers: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous half-open layer ranges covering ``[0, layers)`` as evenly as can be."""
    if not 1 <= shards <= layers:
        raise ValueError(f"cannot cut {layers} layers into {shards} shards")
    bounds = [round(i * layers / shards) for i in range(shards + 1)]
    return list(itertools.pairwise(bounds))


class LocalWorkers:
    def __init__(
        self,
        nats_url: str,
        device_ids: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        per_device_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.device_ids = list(device_ids)
        self.env = env or {}
        self.per_device_env = per_device_env or {}
        self.workers: dict[str, ServiceProcess] = {}

    def start(self, ready_timeout_s: float = 120.0) -> LocalWorkers:
        base = {
            "TESSERA_NATS_URL": self.nats_url,
            # one thread per worker: several workers share this machine's cores
            "OMP_NUM_THREADS": child_env().get("OMP_NUM_THREADS", "1"),
            **self.env,
        }
        for device_id in self.device_ids:
            env = {**base, "TESSERA_WORKER_DEVICE_ID": device_id}
            env.update(self.per_device_env.get(device_id, {}))
            worker = ServiceProcess(f"worker {device_id}", env, ["-m", "services.worker"])
            self.workers[device_id] = worker.start(ready_timeout_s=None)
        for worker in self.workers.values():
            if not worker.wait_ready(ready_timeout_s):
                raise RuntimeError(
                    f"{worker.name} was not ready in {ready_timeout_s} s{worker.tail()}"
                )
        return self

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def __enter__(self) -> LocalWorkers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def shard_tasks(
    deployment_id: str,
    model: str,
    devices: Sequence[str],
    ranges: Sequence[tuple[int, int]],
    epoch: int,
    action: Literal["load", "unload"] = "load",
    endpoints: Sequence[str] = (),
) -> list[ShardTask]:
    """The shard tasks of ``devices`` holding ``ranges`` (the scheduler's own builder);
    ``endpoints``: the devices' llama.cpp RPC addresses (llamacpp workers)."""
    shards = [(d, s, e) for d, (s, e) in zip(devices, ranges, strict=True)]
    return shard_ring(action, deployment_id, model, shards, epoch, time.time(), None, endpoints)


async def place(
    nc: NatsClient,
    tasks: Sequence[ShardTask],
    timeout_s: float = 60.0,
) -> list[ShardStatus]:
    """Publish ``tasks`` and wait for each shard's answer (its final status: loaded, refused
    or failed, not the ``loading`` reports before it); returns the statuses in order."""
    await ensure_streams(nc)
    pending = {(t.device_id, t.shard_index, t.epoch) for t in tasks}
    answers: dict[tuple[str, int, int], ShardStatus] = {}
    done = asyncio.Event()

    async def on_status(status: ShardStatus, msg: Msg) -> None:
        key = (status.device_id, status.shard_index, status.epoch)
        if status.state == "loading":
            return
        if key in pending and status.deployment_id == tasks[0].deployment_id:
            answers[key] = status
            if len(answers) == len(pending):
                done.set()

    sub = await subscribe(nc, SHARD_STATUS, on_status)
    try:
        js = nc.jetstream()
        for task in tasks:
            await js.publish(SHARD_TASK.subject(device_id=task.device_id), SHARD_TASK.encode(task))
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return [answers[(t.device_id, t.shard_index, t.epoch)] for t in tasks]


async def generate_direct(
    nc: NatsClient, request: GenerationRequest, device_id: str, timeout_s: float = 120.0
) -> list[TokenChunk]:
    """Send one request straight to the worker of ``device_id`` (its first shard) and gather
    its chunks up to the finished one (no gateway: the owner's re-run after a move, by hand)."""
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_chunk(chunk: TokenChunk, msg: Msg) -> None:
        chunks.append(chunk)
        if chunk.finished:
            done.set()

    subject = TOKENS.pattern(request_id=request.request_id)
    sub = await subscribe(nc, TOKENS, on_chunk, subject=subject)
    try:
        target = GENERATION.subject(deployment_id=request.deployment_id, device_id=device_id)
        await nc.publish(target, GENERATION.encode(request))
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return chunks
