"""Worker processes on this machine with a deployment placed across them by hand.

The scheduler normally sends the shard tasks; the pipeline tests and ``bench/pipeline.py``
send them directly, so they measure the workers and nothing else. ``even_split`` cuts the
layers into contiguous ranges, ``LocalWorkers`` starts ``python -m services.worker`` processes
(one per device) and ``place`` loads a split on them and waits until every shard reports
``loaded``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from libs.contracts import SHARD_STATUS, SHARD_TASK, ShardStatus, ShardTask
from libs.runtime.bus import ensure_streams, subscribe
from libs.runtime.generation import Route
from libs.runtime.procs import child_kwargs, stop_process


def even_split(layers: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous half-open layer ranges covering ``[0, layers)`` as evenly as can be."""
    if not 1 <= shards <= layers:
        raise ValueError(f"cannot cut {layers} layers into {shards} shards")
    bounds = [round(i * layers / shards) for i in range(shards + 1)]
    return list(itertools.pairwise(bounds))


class WorkerProcess:
    def __init__(self, device_id: str, env: dict[str, str]) -> None:
        self.device_id = device_id
        self.env = env
        self.lines: list[dict[str, Any]] = []
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.worker"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **child_kwargs(),
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                entry = json.loads(raw)
            except ValueError:
                entry = {"msg": raw.decode(errors="replace").rstrip()}
            if isinstance(entry, dict):
                self.lines.append(entry)
                self.events.put(entry)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.events.get(timeout=0.2).get("msg") == "ready":
                    return
            except queue.Empty:
                if self.process.poll() is not None:
                    break
        tail = "\n".join(json.dumps(e) for e in self.lines[-20:])
        raise RuntimeError(f"worker {self.device_id} did not start within {timeout_s} s\n{tail}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        stop_process(self.process, timeout_s=15)


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
        self.workers: dict[str, WorkerProcess] = {}

    def start(self, ready_timeout_s: float = 120.0) -> LocalWorkers:
        base = {
            **os.environ,
            "TESSERA_NATS_URL": self.nats_url,
            "TESSERA_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            # one thread per worker: several workers share this machine's cores
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            **self.env,
        }
        for device_id in self.device_ids:
            env = {**base, "TESSERA_WORKER_DEVICE_ID": device_id}
            env.update(self.per_device_env.get(device_id, {}))
            self.workers[device_id] = WorkerProcess(device_id, env)
        for worker in self.workers.values():
            worker.wait_ready(ready_timeout_s)
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
    action: str = "load",
) -> list[ShardTask]:
    route = tuple(devices)
    return [
        ShardTask(
            action=action,
            deployment_id=deployment_id,
            model=model,
            device_id=device,
            shard_index=i,
            shard_count=len(route),
            layer_start=start,
            layer_end=end,
            next_device_id=route[i + 1] if i + 1 < len(route) else None,
            route=route,
            epoch=epoch,
            ts=time.time(),
        )
        for i, (device, (start, end)) in enumerate(zip(route, ranges, strict=True))
    ]


async def place(
    nc: NatsClient,
    tasks: Sequence[ShardTask],
    timeout_s: float = 60.0,
) -> list[ShardStatus]:
    """Publish ``tasks`` and wait for each shard's answer; returns the statuses in order."""
    await ensure_streams(nc)
    pending = {(t.device_id, t.shard_index, t.epoch) for t in tasks}
    answers: dict[tuple[str, int, int], ShardStatus] = {}
    done = asyncio.Event()

    async def on_status(status: ShardStatus, msg: Msg) -> None:
        key = (status.device_id, status.shard_index, status.epoch)
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


def route_of(tasks: Sequence[ShardTask]) -> Route:
    return Route(tasks[0].deployment_id, tasks[0].epoch, tuple(t.device_id for t in tasks))
