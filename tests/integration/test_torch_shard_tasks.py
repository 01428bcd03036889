"""The torch worker's shard tasks while a shard loads: the real ``TorchWorker`` with the real model
on a real nats-server. Its torch thread (the executor passed in) is held by the test with a
gate, as a long step or a big shard's load would hold it, so a load lasts as long as the test
wants. An unload or a newer epoch is taken during the load, not after it; a load longer than
the consumer's ack wait keeps its task; a load cut short by the worker closing is delivered
again to the worker's next process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from nats.js.api import ConsumerInfo

from libs.agents.emulated_fleet import work_key
from libs.cluster.servers import NatsServer
from libs.contracts import (
    SHARD_STATUS,
    SHARD_TASK,
    STREAMS,
    DeviceClass,
    ShardStatus,
    ShardTask,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.acks import Redelivery
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from services.worker.torch.worker import TorchWorker
from tests.waiting import wait_until, wait_until_async

QUICK = Redelivery(ack_wait_s=1.0, max_deliver=3, retry_delay_s=0.05)
STREAM = next(name for name, subjects in STREAMS.items() if SHARD_TASK.wildcard in subjects)


@pytest.fixture
async def nats_bus(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    nc = await connect_nats(nats_server.url, "torch-tasks")
    await ensure_streams(nc)
    yield NatsBus(nc)
    await close_nats(nc)


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Opened by the test, or at its end (the torch thread must not outlive it)."""
    shut = threading.Event()
    yield shut
    shut.set()


@dataclass
class Rig:
    """A torch worker on the bus whose torch thread waits for ``gate``, and what it reported."""

    bus: NatsBus
    worker: TorchWorker
    compute: ThreadPoolExecutor
    gate: threading.Event
    seen: list[ShardStatus]

    @property
    def got(self) -> list[tuple[str, int]]:
        """The final statuses (all but ``loading``) as (state, epoch)."""
        return [(s.state, s.epoch) for s in self.seen if s.state != "loading"]

    def loading(self, epoch: int) -> bool:
        return any(s.state == "loading" and s.epoch == epoch for s in self.seen)

    async def send(self, action: Any, epoch: int, layers: tuple[int, int] = (0, 4)) -> ShardTask:
        device_id = self.worker.device_id
        [one] = shard_ring(action, "dep", MODEL_NAME, [(device_id, *layers)], epoch, 0)
        await self.bus.publish_durable(SHARD_TASK, one, device_id=device_id)
        return one

    async def drained(self) -> None:
        """Wait until the torch thread has run everything given to it so far."""
        await asyncio.wrap_future(self.compute.submit(lambda: None))

    async def consumer(self) -> ConsumerInfo:
        js = self.bus.nc.jetstream()
        info: ConsumerInfo = await js.consumer_info(STREAM, f"worker-{self.worker.device_id}")
        return info

    async def settled(self) -> None:
        """Wait until every task the worker got is acknowledged (none can come again)."""

        async def nothing_pending() -> bool:
            return (await self.consumer()).num_ack_pending == 0

        await wait_until_async(nothing_pending, timeout_s=10)


def workstation(device_id: str) -> EmulatedDevice:
    return EmulatedDevice.draw(device_id, DeviceClass.WORKSTATION, np.random.default_rng(0))


async def started(bus: NatsBus, device: EmulatedDevice, **kwargs: Any) -> TorchWorker:
    worker = TorchWorker(bus, device, prepare(), **kwargs)
    worker.redelivery = QUICK
    await worker.start()
    return worker


@pytest.fixture
async def rig(nats_bus: NatsBus, uid: str, gate: threading.Event) -> AsyncIterator[Rig]:
    compute = ThreadPoolExecutor(1, thread_name_prefix="torch")
    compute.submit(gate.wait)  # the torch thread is busy until the test opens the gate
    worker = await started(nats_bus, workstation(uid), compute=compute)
    seen: list[ShardStatus] = []

    async def on_status(status: ShardStatus, delivery: Any) -> None:
        seen.append(status)

    sub = await nats_bus.subscribe(
        SHARD_STATUS, on_status, subject=SHARD_STATUS.subject(device_id=uid)
    )
    yield Rig(nats_bus, worker, compute, gate, seen)
    gate.set()
    await worker.close()
    await sub.unsubscribe()


async def test_an_unload_sent_during_a_slow_load_is_taken_at_once(rig: Rig) -> None:
    await rig.send("load", 1)
    await wait_until(lambda: rig.loading(1), timeout_s=15)
    # The gate stays shut: an unload that waits behind the load would never be answered.
    await rig.send("unload", 1)
    await wait_until(lambda: rig.got, timeout_s=15)
    assert rig.got == [("unloaded", 1)]
    rig.gate.set()
    await rig.drained()
    await rig.settled()  # both tasks acknowledged: neither comes again
    assert rig.got == [("unloaded", 1)]  # the superseded load reported nothing
    assert rig.worker.engines == {} and rig.worker.loads == {}
    assert not rig.worker.device.work  # nor did it make the device work


async def test_a_load_longer_than_the_ack_wait_keeps_its_task_and_a_newer_epoch_supersedes_it(
    rig: Rig,
) -> None:
    await rig.send("load", 1)
    await wait_until(lambda: rig.loading(1), timeout_s=15)
    await asyncio.sleep(2.5 * QUICK.ack_wait_s)  # the load outlasts the ack wait
    newer = await rig.send("load", 2, layers=(0, 6))
    await wait_until(lambda: rig.loading(2), timeout_s=15)
    rig.gate.set()
    await wait_until(lambda: rig.got, timeout_s=60)
    await rig.drained()
    await rig.settled()
    assert rig.got == [("loaded", 2)]  # epoch 1: superseded, reported nothing
    assert (await rig.consumer()).num_redelivered == 0  # the long load's task never came again
    engine = rig.worker.engines["dep"]
    assert engine.epoch == 2 and (engine.task.layer_start, engine.task.layer_end) == (0, 6)
    assert list(rig.worker.device.work) == [work_key(newer)]


async def test_a_load_cut_short_by_the_worker_closing_is_delivered_again(
    rig: Rig, nats_bus: NatsBus
) -> None:
    await rig.send("load", 1)
    await wait_until(lambda: rig.loading(1), timeout_s=15)
    await rig.worker.close()  # its torch thread still held: the load had not ended
    assert (await rig.consumer()).num_ack_pending == 1  # not acknowledged

    again = await started(nats_bus, rig.worker.device)  # the worker's next process
    try:
        await wait_until(lambda: rig.got, timeout_s=60)
        assert rig.got == [("loaded", 1)]
        assert again.engines["dep"].epoch == 1
        await rig.settled()
    finally:
        await again.close()
