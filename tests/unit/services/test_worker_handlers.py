"""The CPU shard worker's handlers on the in-memory bus, with the real model: shard tasks reach
it through its durable consumer (also the ones sent while it was away), hidden-state frames
travel between two workers as bytes, and what breaks a contract is counted, not fatal."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from libs.contracts import (
    GENERATION,
    HIDDEN,
    SHARD_STATUS,
    SHARD_TASK,
    TOKENS,
    DeviceClass,
    GenerationRequest,
    Sampling,
    TokenChunk,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.memory_bus import MemoryBus
from libs.runtime.memory_subscriptions import matches
from services.worker.torch.worker import TorchWorker
from tests.waiting import wait_until

LAYERS = 30
PROMPT = (1, 504, 3458, 282, 4649, 314, 2)


def device(device_id: str) -> EmulatedDevice:
    drawn = EmulatedDevice.draw(device_id, DeviceClass.WORKSTATION, np.random.default_rng(0))
    return dataclasses.replace(drawn, speed_factor=1.0)  # no emulated slowdown


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    memory = MemoryBus()
    yield memory
    await memory.close()


async def generate(bus: MemoryBus, deployment: str, first: str, epoch: int) -> list[int]:
    request = GenerationRequest(
        request_id=f"req-{deployment}",
        deployment_id=deployment,
        epoch=epoch,
        prompt_token_ids=PROMPT,
        sampling=Sampling(max_tokens=8),
        ts=time.time(),
    )
    await bus.publish(GENERATION, request, deployment_id=deployment, device_id=first)

    def chunks() -> list[TokenChunk]:
        return [c for c in bus.sent(TOKENS) if c.request_id == request.request_id]

    await wait_until(lambda: any(c.finished for c in chunks()), timeout_s=60)
    assert all(c.error is None for c in chunks()), chunks()
    return [c.token_id for c in chunks() if c.token_id is not None]


async def test_a_split_model_over_the_memory_bus_matches_the_whole_model(bus: MemoryBus) -> None:
    folder = prepare()
    head = TorchWorker(bus, device("ws-a"), folder)
    await head.start()
    gone = TorchWorker(bus, device("ws-b"), folder)
    await gone.start()
    await gone.close()  # ws-b's process goes away; its durable consumer stays
    split = shard_ring("load", "split", MODEL_NAME, [("ws-a", 0, 12), ("ws-b", 12, LAYERS)], 1, 0)
    whole = shard_ring("load", "whole", MODEL_NAME, [("ws-a", 0, LAYERS)], 1, 0)
    for task in (*split, *whole):
        await bus.publish_durable(SHARD_TASK, task, device_id=task.device_id)
    tail = TorchWorker(bus, device("ws-b"), folder)
    await tail.start()  # back: the task sent while it was away reaches it now

    want = {("split", "ws-a"), ("split", "ws-b"), ("whole", "ws-a")}
    await wait_until(
        lambda: (
            {(s.deployment_id, s.device_id) for s in bus.sent(SHARD_STATUS) if s.state == "loaded"}
            >= want
        ),
        timeout_s=60,
    )
    assert {s.state for s in bus.sent(SHARD_STATUS)} == {"loading", "loaded"}

    split_tokens = await generate(bus, "split", "ws-a", 1)
    whole_tokens = await generate(bus, "whole", "ws-a", 1)
    assert len(split_tokens) == 8
    assert split_tokens == whole_tokens
    to_tail = [d for d in bus.published if matches(HIDDEN.pattern(device_id="ws-b"), d.subject)]
    assert len(to_tail) >= 8  # the prefill's hidden states and one frame per decode step
    await head.close()
    await tail.close()


async def test_what_breaks_a_contract_is_counted_and_the_worker_carries_on(bus: MemoryBus) -> None:
    worker = TorchWorker(bus, device("ws-c"), prepare())
    await worker.start()
    bus.send_raw(SHARD_TASK.subject(device_id="ws-c"), b'{"action": "explode"}')
    bus.send_raw(HIDDEN.subject(deployment_id="d", device_id="ws-c", sender_id="ws-x"), b"\x00bad")
    [task] = shard_ring("load", "d", MODEL_NAME, [("ws-c", 0, LAYERS)], 1, 0)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-c")
    await wait_until(lambda: [s.state for s in bus.sent(SHARD_STATUS)][-1:] == ["loaded"], 60)
    rejected = {
        labels["channel"]: value
        for metric in worker.metrics.rejected.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
        for labels, value in [(sample.labels, sample.value)]
    }
    assert rejected == {SHARD_TASK.name: 1.0, HIDDEN.name: 1.0}
    await worker.close()


async def test_a_shard_is_loaded_in_its_deployments_precision(bus: MemoryBus) -> None:
    worker = TorchWorker(bus, device("ws-p"), prepare())  # its own precision: int8
    await worker.start()
    [task] = shard_ring("load", "wide", MODEL_NAME, [("ws-p", 0, 4)], 1, 0, "bfloat16")
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-p")
    await wait_until(lambda: [s.state for s in bus.sent(SHARD_STATUS)][-1:] == ["loaded"], 60)
    assert list(worker.held.loaded) == [(0, 4, "bfloat16")]
    assert worker.held.loaded[(0, 4, "bfloat16")].precision == "bfloat16"
    await worker.close()


async def test_a_load_task_sent_again_is_answered_loaded_again(bus: MemoryBus) -> None:
    """A scheduler that takes over re-sends the load tasks of the plans it found loading: a
    worker that already serves the shard says so again (its first answer may have been lost)."""
    worker = TorchWorker(bus, device("ws-r"), prepare())
    await worker.start()
    [task] = shard_ring("load", "again", MODEL_NAME, [("ws-r", 0, 4)], 1, 0)

    def loaded() -> int:
        return sum(
            s.state == "loaded" and s.deployment_id == "again" for s in bus.sent(SHARD_STATUS)
        )

    await bus.publish_durable(SHARD_TASK, task, device_id="ws-r")
    await wait_until(lambda: loaded() == 1, 60)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-r")
    await wait_until(lambda: loaded() == 2, 60)
    assert list(worker.engines) == ["again"]  # answered, not loaded twice
    assert len(worker.held.loaded) == 1
    await worker.close()


async def test_a_load_delivered_after_its_unload_is_dropped(bus: MemoryBus) -> None:
    """A worker back from a crash gets its consumer's news in an order of its own: the unload
    of a re-planned epoch first, the load it was killed in later. That load is stale; a load
    sent after the unload (the same id deployed again) is not."""
    worker = TorchWorker(bus, device("ws-s"), prepare())
    await worker.start()
    [load] = shard_ring("load", "late", MODEL_NAME, [("ws-s", 0, 4)], 1, 100.0)
    [unload] = shard_ring("unload", "late", MODEL_NAME, [("ws-s", 0, 4)], 1, 200.0)
    await bus.publish_durable(SHARD_TASK, unload, device_id="ws-s")
    await bus.publish_durable(SHARD_TASK, load, device_id="ws-s")
    [again] = shard_ring("load", "late", MODEL_NAME, [("ws-s", 0, 4)], 1, 300.0)
    await bus.publish_durable(SHARD_TASK, again, device_id="ws-s")
    await wait_until(lambda: [s.state for s in bus.sent(SHARD_STATUS)][-1:] == ["loaded"], 60)
    loads = [s for s in bus.sent(SHARD_STATUS) if s.state in ("loading", "loaded")]
    # One load began (at progress 0; a slow one reports its progress as it goes): the stale
    # load never did.
    began = [s for s in loads if s.state == "loading" and s.progress == 0.0]
    assert len(began) == 1 and loads[-1].state == "loaded", [(s.state, s.progress) for s in loads]
    assert list(worker.engines) == ["late"]
    await worker.close()
