"""The acknowledgement policy (``libs/runtime/acks.py``), scenario by scenario, on both buses:
``MemoryBus`` and ``NatsBus`` over a real nats-server must behave alike, so a handler's unit
test on the memory bus sees what JetStream would do (redelivery, termination, ack wait)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from libs.cluster.servers import NatsServer
from libs.contracts import SHARD_TASK, STREAMS, ContractError, ShardTask, shard_ring
from libs.runtime.acks import Received, Redelivery
from libs.runtime.bus import Bus, Delivery, NatsBus, Unsubscribe
from libs.runtime.memory_bus import MemoryBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from tests.waiting import wait_until, wait_until_async

#: Short enough for a test to pass several ack waits, long enough for a busy 2-core machine.
QUICK = Redelivery(ack_wait_s=1.0, max_deliver=3, retry_delay_s=0.05)
#: The epoch of the marker sent after each scenario: once it is handled, whatever the
#: scenario's messages would bring (a redelivery queued before it) has been handled too.
MARKER = 99
STREAM = next(name for name, subjects in STREAMS.items() if SHARD_TASK.wildcard in subjects)


@pytest.fixture(params=["memory", "nats"])
async def bus(request: pytest.FixtureRequest, nats_server: NatsServer) -> AsyncIterator[Bus]:
    if request.param == "memory":
        memory = MemoryBus()
        yield memory
        await memory.close()
        return
    nc = await connect_nats(nats_server.url, "acks")
    await ensure_streams(nc)
    yield NatsBus(nc)
    await close_nats(nc)


def task(device_id: str, epoch: int) -> ShardTask:
    [one] = shard_ring("load", "d", "smollm2-135m-instruct", [(device_id, 0, 30)], epoch, 0.0)
    return one


async def unsettled(bus: Bus, durable: str) -> int:
    """Messages delivered to ``durable`` and not settled: what could still come again."""
    if isinstance(bus, MemoryBus):
        return bus.unsettled(durable)
    assert isinstance(bus, NatsBus)
    info = await bus.nc.jetstream().consumer_info(STREAM, durable)
    return int(info.num_ack_pending or 0)


class Handler:
    """Records (epoch, attempt) of each delivery; fails the first ``fails[epoch]`` attempts
    of an epoch (transient), refuses ``breaches`` for good, holds ``holds`` for ``hold_s``."""

    def __init__(
        self,
        fails: dict[int, int] | None = None,
        breaches: frozenset[int] = frozenset(),
        hold_s: float = 0.0,
    ) -> None:
        self.fails, self.breaches, self.hold_s = fails or {}, breaches, hold_s
        self.seen: list[tuple[int, int]] = []

    async def __call__(self, task: ShardTask, delivery: Received) -> None:
        self.seen.append((task.epoch, delivery.attempt))
        if task.epoch in self.breaches:
            raise ContractError("wrong_device", f"epoch {task.epoch} is not for this handler")
        if delivery.attempt <= self.fails.get(task.epoch, 0):
            raise RuntimeError("a transient failure")
        if task.epoch != MARKER:
            await asyncio.sleep(self.hold_s)


class Scenario:
    def __init__(self, bus: Bus, uid: str) -> None:
        self.bus, self.uid, self.durable = bus, uid, f"c-{uid}"
        self.subject = SHARD_TASK.subject(device_id=uid)
        self.rejected: list[str] = []

    async def consume(self, handler: Handler) -> Unsubscribe:
        return await self.bus.consume(
            SHARD_TASK,
            handler,
            durable=self.durable,
            subject=self.subject,
            rejected=lambda channel, reason, detail: self.rejected.append(reason),
            redelivery=QUICK,
        )

    async def send(self, epoch: int) -> None:
        await self.bus.publish_durable(SHARD_TASK, task(self.uid, epoch), device_id=self.uid)

    async def finish(self, handler: Handler) -> list[tuple[int, int]]:
        """Send the marker, wait until it is handled and nothing is left to come again;
        what the handler saw before the marker."""
        await self.send(MARKER)
        await wait_until(lambda: (MARKER, 1) in handler.seen, timeout_s=10)
        await wait_until_async(self._settled, timeout_s=10)  # the marker's ack has landed
        return [seen for seen in handler.seen if seen[0] != MARKER]

    async def _settled(self) -> bool:
        return await unsettled(self.bus, self.durable) == 0

    async def away(self, sub: Unsubscribe) -> None:
        """Unsubscribe and wait until the server knows nobody takes the consumer's messages."""
        await sub.unsubscribe()
        if isinstance(self.bus, NatsBus):
            js = self.bus.nc.jetstream()

            async def unbound() -> bool:
                return not (await js.consumer_info(STREAM, self.durable)).push_bound

            await wait_until_async(unbound, timeout_s=10)


async def test_a_task_whose_handler_fails_is_delivered_again(bus: Bus, uid: str) -> None:
    scenario, handler = Scenario(bus, uid), Handler(fails={1: 1})
    sub = await scenario.consume(handler)
    await scenario.send(1)
    await wait_until(lambda: (1, 2) in handler.seen, timeout_s=10)
    assert await scenario.finish(handler) == [(1, 1), (1, 2)]
    await sub.unsubscribe()


async def test_a_task_that_always_fails_is_given_up_after_max_deliver(bus: Bus, uid: str) -> None:
    scenario, handler = Scenario(bus, uid), Handler(fails={1: 1000})
    sub = await scenario.consume(handler)
    await scenario.send(1)
    await wait_until(lambda: (1, QUICK.max_deliver) in handler.seen, timeout_s=10)
    assert await scenario.finish(handler) == [(1, n + 1) for n in range(QUICK.max_deliver)]
    await sub.unsubscribe()


async def test_a_contract_breach_is_not_delivered_again(bus: Bus, uid: str) -> None:
    scenario, handler = Scenario(bus, uid), Handler(breaches=frozenset({1}))
    sub = await scenario.consume(handler)
    await scenario.send(1)
    await bus.publish_bytes(scenario.subject, b"{}")  # the stream takes it: it breaks the contract
    await scenario.send(2)
    assert await scenario.finish(handler) == [(1, 1), (2, 1)]
    assert scenario.rejected == ["wrong_fields"]
    await sub.unsubscribe()


async def test_a_long_handler_keeps_its_task_past_the_ack_wait(bus: Bus, uid: str) -> None:
    scenario, handler = Scenario(bus, uid), Handler(hold_s=2.5 * QUICK.ack_wait_s)
    sub = await scenario.consume(handler)
    await scenario.send(1)
    assert await scenario.finish(handler) == [(1, 1)]  # in-progress acks kept it
    await sub.unsubscribe()


async def test_a_durable_consumer_resumes_where_it_left_off(bus: Bus, uid: str) -> None:
    scenario, handler = Scenario(bus, uid), Handler()
    await scenario.send(1)  # before the consumer exists: not its (DeliverPolicy.NEW)
    sub = await scenario.consume(handler)
    await scenario.send(2)
    await wait_until(lambda: (2, 1) in handler.seen, timeout_s=10)
    await scenario.away(sub)
    await scenario.send(3)  # while its process is away
    sub = await scenario.consume(handler)
    assert await scenario.finish(handler) == [(2, 1), (3, 1)]
    await sub.unsubscribe()


async def test_work_cut_off_with_its_consumer_is_delivered_again(bus: Bus, uid: str) -> None:
    """A worker killed in the middle of a task: its next process gets the task again."""
    scenario, stuck = Scenario(bus, uid), Handler(hold_s=3600)
    sub = await scenario.consume(stuck)
    await scenario.send(1)
    await wait_until(lambda: stuck.seen == [(1, 1)], timeout_s=10)
    await scenario.away(sub)
    handler = Handler()
    sub = await scenario.consume(handler)
    await wait_until(lambda: handler.seen, timeout_s=10)  # once the ack wait has passed
    assert await scenario.finish(handler) == [(1, 2)]
    await sub.unsubscribe()


async def test_a_plain_subscriber_sees_nothing_published_before_it(bus: Bus, uid: str) -> None:
    seen: list[int] = []

    async def on_task(message: ShardTask, delivery: Delivery) -> None:
        seen.append(message.epoch)

    await bus.publish_durable(SHARD_TASK, task(uid, 1), device_id=uid)
    sub = await bus.subscribe(SHARD_TASK, on_task, subject=SHARD_TASK.subject(device_id=uid))
    await bus.flush()
    await bus.publish_durable(SHARD_TASK, task(uid, 2), device_id=uid)
    await bus.publish(SHARD_TASK, task(uid, 3), device_id=uid)
    await wait_until(lambda: 3 in seen, timeout_s=10)
    assert seen == [2, 3]  # live messages only, a durable one among them; no replay
    await sub.unsubscribe()
