"""One owner of a device's work: the worker. Its own telemetry agent (as ``python -m
services.worker`` runs it) reports what the device does and assigns nothing itself, so a shard
the worker refused leaves the device's reported power and load as they were, and a shard it
loaded is reported ``loading`` first and counts as work once ``loaded``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest

from libs.agents.emulated_fleet import FleetAgent
from libs.contracts import (
    SHARD_STATUS,
    SHARD_TASK,
    TELEMETRY,
    DeviceClass,
    ShardStatus,
    TelemetrySample,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.memory_bus import MemoryBus
from services.worker.torch.worker import TorchWorker
from tests.waiting import wait_until


def device(device_id: str, memory_gb: float | None = None) -> EmulatedDevice:
    drawn = EmulatedDevice.draw(device_id, DeviceClass.WORKSTATION, np.random.default_rng(0))
    caps = drawn.capabilities
    if memory_gb is not None:
        caps = caps.model_copy(update={"memory_total_gb": memory_gb})
    return dataclasses.replace(drawn, capabilities=caps, speed_factor=1.0, engines=("torch",))


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    memory = MemoryBus()
    yield memory
    await memory.close()


async def run_device(bus: MemoryBus, dev: EmulatedDevice) -> tuple[TorchWorker, asyncio.Event]:
    """The worker process's parts: the torch worker and its device's agent."""
    worker = TorchWorker(bus, dev, prepare())
    await worker.start()
    stop = asyncio.Event()
    agent = FleetAgent(bus, [dev], interval_s=0.2, follow_work=False)
    asyncio.get_running_loop().create_task(agent.run(stop))
    return worker, stop


def states(bus: MemoryBus, deployment: str) -> list[str]:
    return [s.state for s in bus.sent(SHARD_STATUS) if s.deployment_id == deployment]


def last_sample(bus: MemoryBus, device_id: str) -> TelemetrySample:
    return [s for s in bus.sent(TELEMETRY) if s.device_id == device_id][-1]


async def fresh_sample(bus: MemoryBus, device_id: str) -> TelemetrySample:
    """A sample published after now."""
    count = len(bus.sent(TELEMETRY))
    await wait_until(lambda: len(bus.sent(TELEMETRY)) > count + 1, timeout_s=10)
    return last_sample(bus, device_id)


@pytest.mark.parametrize(
    ("model", "memory_gb", "why"),
    [
        ("llama-3.2-1b-instruct", None, "has no weights of llama-3.2-1b-instruct"),
        (MODEL_NAME, 0.1, "does not fit"),
    ],
)
async def test_a_refused_shard_leaves_the_devices_power_and_load_as_they_were(
    bus: MemoryBus, model: str, memory_gb: float | None, why: str
) -> None:
    dev = device("ws-r", memory_gb)
    worker, stop = await run_device(bus, dev)
    before = await fresh_sample(bus, "ws-r")
    [task] = shard_ring("load", "big", model, [("ws-r", 0, 16)], 1, 0)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-r")
    await wait_until(lambda: "refused" in states(bus, "big"), timeout_s=60)
    after = await fresh_sample(bus, "ws-r")
    stop.set()
    await worker.close()

    [refusal] = [s for s in bus.sent(SHARD_STATUS) if s.state == "refused"]
    assert why in (refusal.reason or "")
    assert dev.work == {}
    assert (after.running_tasks, after.cpu_utilisation) == (0, 0.0)
    assert (before.running_tasks, before.cpu_utilisation) == (0, 0.0)
    assert (after.power_w or 0.0) <= (before.power_w or 0.0)  # idle then, idle or asleep now


async def test_a_loaded_shard_reports_loading_then_loaded_and_then_counts_as_work(
    bus: MemoryBus,
) -> None:
    dev = device("ws-l")
    worker, stop = await run_device(bus, dev)
    idle = await fresh_sample(bus, "ws-l")
    [task] = shard_ring("load", "small", MODEL_NAME, [("ws-l", 0, 4)], 1, 0)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-l")
    await wait_until(lambda: "loaded" in states(bus, "small"), timeout_s=60)
    busy = await fresh_sample(bus, "ws-l")
    [unload] = shard_ring("unload", "small", MODEL_NAME, [("ws-l", 0, 4)], 1, 0)
    await bus.publish_durable(SHARD_TASK, unload, device_id="ws-l")
    await wait_until(lambda: "unloaded" in states(bus, "small"), timeout_s=10)
    stop.set()
    await worker.close()

    seen = states(bus, "small")
    assert seen[0] == "loading" and seen[-2:] == ["loaded", "unloaded"]
    statuses: list[ShardStatus] = [s for s in bus.sent(SHARD_STATUS)]
    progress = [s.progress for s in statuses if s.state in ("loading", "loaded")]
    assert progress[0] == 0.0 and progress[-1] == 1.0
    assert progress == sorted(p or 0.0 for p in progress)  # it only goes up
    assert busy.running_tasks == 1 and busy.cpu_utilisation > idle.cpu_utilisation
    assert dev.work == {}  # unloaded: no work left
