"""The torch worker's engine has one writer: cancels and expiries hammered at it while its
steps run (the real model, on the in-memory bus) are applied between steps on the torch
thread, so no step sees its requests change under it, and every request ends once: finished
with its tokens in order, cancelled, or expired."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from libs.contracts import (
    CANCEL,
    GENERATION,
    SHARD_TASK,
    TOKENS,
    DeviceClass,
    GenerationCancel,
    GenerationRequest,
    Sampling,
    TokenChunk,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.memory_bus import MemoryBus
from services.worker.torch.worker import TorchWorker
from tests.waiting import wait_until

LAYERS = 30
PROMPT = (1, 504, 3458, 282, 4649, 314, 2)
REQUESTS = 16  #: as many as the slots and the waiting line hold: none refused
MAX_TOKENS = 10


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    memory = MemoryBus()
    yield memory
    await memory.close()


def request(i: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"req-{i}",
        deployment_id="dep",
        epoch=1,
        prompt_token_ids=PROMPT,
        sampling=Sampling(max_tokens=MAX_TOKENS),
        ts=time.time(),
    )


async def test_cancels_and_expiries_during_steps_are_applied_between_them(bus: MemoryBus) -> None:
    drawn = EmulatedDevice.draw("ws-x", DeviceClass.WORKSTATION, np.random.default_rng(0))
    worker = TorchWorker(bus, dataclasses.replace(drawn, speed_factor=1.0), prepare(), max_active=8)
    await worker.start()
    [task] = shard_ring("load", "dep", MODEL_NAME, [("ws-x", 0, LAYERS)], 1, 0)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-x")
    await wait_until(lambda: "dep" in worker.engines, timeout_s=60)
    engine = worker.engines["dep"]

    # Watch the engine from inside: what each step runs on, and where changes are applied.
    torn: list[str] = []  # steps whose requests changed while the model ran
    applied: list[tuple[str, str]] = []  # (what, thread) of each cancel or expiry that dropped
    expired: list[str] = []
    model_step, cancel, expire = engine.model.step, engine.cancel, engine.expire

    def state() -> tuple[frozenset[str], tuple[str, ...]]:
        return frozenset(engine.live), tuple(r.request_id for r in engine.waiting)

    def watched_step(*args: Any) -> Any:
        before = state()
        out = model_step(*args)
        if state() != before:
            torn.append(f"{sorted(before[0])} -> {sorted(state()[0])}")
        return out

    def watched_cancel(request_id: str) -> bool:
        dropped = cancel(request_id)
        if dropped:
            applied.append((f"cancel {request_id}", threading.current_thread().name))
        return dropped

    def watched_expire(idle_s: float) -> list[str]:
        dropped = expire(idle_s)
        expired.extend(dropped)
        applied.extend((f"expire {r}", threading.current_thread().name) for r in dropped)
        return dropped

    engine.model.step = watched_step  # type: ignore[method-assign,assignment]
    engine.cancel = watched_cancel  # type: ignore[method-assign]
    engine.expire = watched_expire  # type: ignore[method-assign]

    def chunks() -> dict[str, list[TokenChunk]]:
        out: dict[str, list[TokenChunk]] = {}
        for chunk in bus.sent(TOKENS):
            out.setdefault(chunk.request_id, []).append(chunk)
        return out

    cancelled = {f"req-{i}" for i in range(REQUESTS) if i % 3 == 1}
    for i in range(REQUESTS):
        await bus.publish(GENERATION, request(i), deployment_id="dep", device_id="ws-x")
    # Hammer while the steps run: a cancel every few milliseconds, and two expiries of all
    # that is running (as if their ends were lost).
    for n, request_id in enumerate(sorted(cancelled)):
        await asyncio.sleep(0.003)
        stop = GenerationCancel(request_id=request_id, ts=time.time())
        await bus.publish(CANCEL, stop, deployment_id="dep")
        if n in (2, 5):
            await worker.expire(0.0)

    def settled() -> bool:
        ended = {r for r, c in chunks().items() if any(x.finished for x in c)}
        idle = not engine.live and not engine.waiting and worker.inbox.queue.empty()
        return idle and ended | cancelled | set(expired) >= {f"req-{i}" for i in range(REQUESTS)}

    await wait_until(settled, timeout_s=120)
    await worker.close()

    assert torn == []
    assert applied and {thread for _, thread in applied} == {"torch_0"}
    assert expired  # the expiries did drop running requests
    assert chunks()  # the requests not cancelled answered
    for request_id, got in chunks().items():
        assert all(c.error is None for c in got), got
        finished = Counter(c.finished for c in got)[True]
        assert finished <= 1, f"{request_id} finished {finished} times"
        indices = [c.index for c in got if c.token_id is not None]
        assert indices == list(range(len(indices))), f"{request_id}: {indices}"
        if request_id not in cancelled and request_id not in expired:
            assert finished == 1, f"{request_id} never finished"
