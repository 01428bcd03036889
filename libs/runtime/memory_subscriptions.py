"""What ``MemoryBus`` delivers to, as NATS and JetStream do: subject matching, the messages
themselves, subscriptions (each with its own queue and task, so delivery is asynchronous and in
order) and durable consumers with the server's redelivery rules (``MemoryConsumer``). The bus
that holds them (``libs/runtime/memory_bus.py``) is seen here only through ``BusState``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from libs.runtime.acks import Redelivery
from libs.runtime.cancelling import stopping


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` stands for one token, a final ``>`` for one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


class BusState(Protocol):
    """What a subscription and a durable consumer read of the bus that holds them: its live
    subscriptions and what its streams captured, in order."""

    subscriptions: list[MemorySubscription]
    stream: list[MemoryDelivery]


@dataclass(frozen=True)
class MemoryDelivery:
    subject: str
    data: bytes
    reply: str = ""
    headers: Mapping[str, str] | None = None


@dataclass(eq=False)
class MemorySubscription:
    bus: BusState
    pattern: str
    queue_group: str
    callback: Callable[[Any], Awaitable[object]]
    #: The durable consumer it takes messages for ("" for a plain subscription).
    consumer: str = ""
    inbox: asyncio.Queue[MemoryDelivery | MemoryJsMsg] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    #: Deliveries queued or being handled.
    pending: int = 0

    def push(self, delivery: MemoryDelivery | MemoryJsMsg) -> None:
        self.pending += 1
        self.inbox.put_nowait(delivery)

    async def run(self) -> None:
        while not stopping():
            delivery = await self.inbox.get()
            try:
                await self.callback(delivery)
            finally:
                self.pending -= 1

    async def unsubscribe(self) -> None:
        if self in self.bus.subscriptions:
            self.bus.subscriptions.remove(self)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


@dataclass(frozen=True)
class MemoryMetadata:
    num_delivered: int


@dataclass(eq=False)
class MemoryJsMsg:
    """A message a durable consumer delivers, settled as a JetStream ``Msg`` is (once)."""

    consumer: MemoryConsumer
    index: int  #: its place in the stream
    subject: str
    data: bytes
    headers: Mapping[str, str] | None
    metadata: MemoryMetadata
    reply: str = ""
    settled: bool = False

    async def ack(self) -> None:
        self._settle()
        self.consumer.done(self.index)

    async def term(self) -> None:
        self._settle()
        self.consumer.done(self.index)

    async def nak(self, delay: float | None = None) -> None:
        self._settle()
        self.consumer.again(self.index, delay or 0.0)

    async def in_progress(self) -> None:
        if self.settled:
            raise RuntimeError("in progress after the message was settled")
        self.consumer.again(self.index, self.consumer.redelivery.ack_wait_s)

    def _settle(self) -> None:
        if self.settled:
            raise RuntimeError("message already settled")  # as nats-py's MsgAlreadyAckdError
        self.settled = True


@dataclass(eq=False)
class MemoryConsumer:
    """A durable consumer of the stream, as JetStream keeps one: it starts at the stream's end
    (``DeliverPolicy.NEW``), delivers new messages in order to its subscriber while it has
    one, and keeps what it delivered until it is acknowledged: a message not settled within
    ``ack_wait_s``, or nak'd, is delivered again (``max_deliver`` times in all)."""

    bus: BusState
    pattern: str
    redelivery: Redelivery
    #: The stream index of the next new message to look at.
    next_index: int
    sub: MemorySubscription | None = None
    #: Stream index -> deliveries so far, for each message delivered and not yet settled.
    unsettled: dict[int, int] = field(default_factory=dict)
    #: When each unsettled message is delivered again (ack wait, nak delay).
    timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    #: Messages to deliver again, waiting for a subscriber.
    due: list[int] = field(default_factory=list)

    @property
    def bound(self) -> bool:
        return self.sub is not None and self.sub in self.bus.subscriptions

    def pump(self) -> None:
        """Deliver what is due, then what is new, to the subscriber (if there is one)."""
        if not self.bound:
            return
        due, self.due = sorted(self.due), []
        for index in due:
            self._send(index)
        stream = self.bus.stream
        while self.next_index < len(stream):
            index, self.next_index = self.next_index, self.next_index + 1
            if matches(self.pattern, stream[index].subject):
                self._send(index)

    def _send(self, index: int) -> None:
        assert self.sub is not None
        count = self.unsettled.get(index, 0) + 1
        self.unsettled[index] = count
        self.again(index, self.redelivery.ack_wait_s)
        stored = self.bus.stream[index]
        self.sub.push(
            MemoryJsMsg(
                self, index, stored.subject, stored.data, stored.headers, MemoryMetadata(count)
            )
        )

    def again(self, index: int, after_s: float) -> None:
        """Deliver message ``index`` again in ``after_s`` unless it is settled before."""
        if index not in self.unsettled:
            return
        old = self.timers.pop(index, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self.timers[index] = loop.call_later(after_s, self._expired, index)

    def done(self, index: int) -> None:
        self.unsettled.pop(index, None)
        timer = self.timers.pop(index, None)
        if timer is not None:
            timer.cancel()

    def _expired(self, index: int) -> None:
        self.timers.pop(index, None)
        if index not in self.unsettled:
            return
        if self.unsettled[index] >= self.redelivery.max_deliver:
            del self.unsettled[index]  # given up, as the server gives up
            return
        self.due.append(index)
        self.pump()

    def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
