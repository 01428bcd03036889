"""``MemoryBus``: the ``Bus`` in one process, for unit tests of a service's handlers.

Subjects, wildcards (``*`` one token, ``>`` the rest), queue groups (each message to one
member) and request/reply behave as on NATS; every message is encoded and decoded through its
channel, so a handler sees exactly what it would over the wire, and a malformed one is
rejected the same way. Each subscription has its own queue and task, so delivery is
asynchronous and in order, as on NATS; ``settle()`` waits until every queue is empty and
every handler has returned. Durable publishes are kept for a subscriber that comes later (as
JetStream keeps them), and a durable consumer (``consume``) gets what was published while it
was away. Nothing here touches the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from libs.contracts import Channel
from libs.runtime.bus import Handler, RawHandler, Rejected, decoding, guarded

M = TypeVar("M", bound=BaseModel)
N = TypeVar("N", bound=BaseModel)


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` stands for one token, a final ``>`` for one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


@dataclass(frozen=True)
class MemoryDelivery:
    subject: str
    data: bytes
    reply: str = ""
    headers: Mapping[str, str] | None = None


@dataclass(eq=False)
class MemorySubscription:
    bus: MemoryBus
    pattern: str
    queue_group: str
    callback: Callable[[Any], Awaitable[object]]
    #: The durable consumer it takes messages for ("" for a plain subscription).
    consumer: str = ""
    inbox: asyncio.Queue[MemoryDelivery] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    #: Deliveries queued or being handled.
    pending: int = 0

    def push(self, delivery: MemoryDelivery) -> None:
        self.pending += 1
        self.inbox.put_nowait(delivery)

    async def run(self) -> None:
        while True:
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


@dataclass(eq=False)
class MemoryConsumer:
    """A durable consumer: while nobody takes its messages, they wait in ``backlog``."""

    pattern: str
    backlog: list[MemoryDelivery] = field(default_factory=list)
    sub: MemorySubscription | None = None

    def take(self, delivery: MemoryDelivery) -> None:
        if self.sub is not None and self.sub in self.sub.bus.subscriptions:
            self.sub.push(delivery)
        else:
            self.backlog.append(delivery)


class MemoryBus:
    def __init__(self) -> None:
        self.subscriptions: list[MemorySubscription] = []
        self.consumers: dict[str, MemoryConsumer] = {}
        #: Every subject published, in order (what a test asserts was sent).
        self.published: list[MemoryDelivery] = []
        self._durable: list[MemoryDelivery] = []
        self._turn = itertools.count()
        self._inboxes = itertools.count()

    # -- Bus -----------------------------------------------------------------------------------
    async def publish(self, channel: Channel[M], message: M, **tokens: str) -> None:
        self.deliver(MemoryDelivery(channel.subject(**tokens), channel.encode(message)))

    async def publish_durable(self, channel: Channel[M], message: M, **tokens: str) -> None:
        delivery = MemoryDelivery(channel.subject(**tokens), channel.encode(message))
        self._durable.append(delivery)
        self.deliver(delivery)

    async def reply(self, subject: str, channel: Channel[M], message: M) -> None:
        self.deliver(MemoryDelivery(subject, channel.encode(message)))

    async def subscribe(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        rejected: Rejected | None = None,
        queue: str = "",
        subject: str | None = None,
    ) -> MemorySubscription:
        sub = self._add(subject or channel.wildcard, queue, decoding(channel, handler, rejected))
        for delivery in self._durable:  # a stream keeps what was published before
            if matches(sub.pattern, delivery.subject):
                sub.push(delivery)
        return sub

    async def consume(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        durable: str,
        subject: str | None = None,
        rejected: Rejected | None = None,
    ) -> MemorySubscription:
        pattern = subject or channel.wildcard
        consumer = self.consumers.setdefault(durable, MemoryConsumer(pattern))
        consumer.sub = self._add(pattern, "", decoding(channel, handler, rejected), durable)
        for delivery in consumer.backlog:
            consumer.sub.push(delivery)
        consumer.backlog.clear()
        return consumer.sub

    async def publish_bytes(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        self.deliver(MemoryDelivery(subject, data, "", headers))

    async def subscribe_bytes(self, subject: str, handler: RawHandler) -> MemorySubscription:
        return self._add(subject, "", guarded(subject, handler))

    async def request(
        self, channel: Channel[M], message: M, answer: Channel[N], timeout_s: float, **tokens: str
    ) -> N:
        return answer.decode(await self._round_trip(channel, message, timeout_s, tokens))

    async def ask(self, channel: Channel[M], message: M, timeout_s: float, **tokens: str) -> bool:
        try:
            await self._round_trip(channel, message, timeout_s, tokens)
        except TimeoutError:
            return False
        return True

    async def _round_trip(
        self, channel: Channel[M], message: M, timeout_s: float, tokens: dict[str, str]
    ) -> bytes:
        """Send ``message`` with a reply inbox and return the first answer's bytes;
        ``TimeoutError`` when nobody listens or answers in time."""
        inbox = f"_INBOX.{next(self._inboxes)}"
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_reply(delivery: MemoryDelivery) -> None:
            if not got.done():
                got.set_result(delivery.data)

        sub = self._add(inbox, "", on_reply)
        try:
            subject = channel.subject(**tokens)
            if not self.deliver(MemoryDelivery(subject, channel.encode(message), inbox)):
                raise TimeoutError(f"no responders on {subject}")
            return await asyncio.wait_for(got, timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"no answer on {subject} within {timeout_s} s") from exc
        finally:
            await sub.unsubscribe()

    async def flush(self, timeout_s: float = 5.0) -> None:
        await self.settle(timeout_s)

    def sent(self, channel: Channel[M]) -> list[M]:
        """Every message published on ``channel`` so far, decoded, in order."""
        return [
            channel.decode(d.data) for d in self.published if matches(channel.wildcard, d.subject)
        ]

    def answer(self, delivery: MemoryDelivery, data: bytes = b"") -> None:
        """Answer a request (what ``msg.respond`` does on NATS)."""
        self.deliver(MemoryDelivery(delivery.reply, data))

    # -- in-process delivery -------------------------------------------------------------------
    def send_raw(self, subject: str, data: bytes) -> bool:
        """Publish bytes as they are (a malformed message, as a hostile client would)."""
        return self.deliver(MemoryDelivery(subject, data))

    def deliver(self, delivery: MemoryDelivery) -> bool:
        """Queue ``delivery`` for every matching subscriber (one per queue group); False if
        nobody was listening."""
        self.published.append(delivery)
        plain: list[MemorySubscription] = []
        groups: dict[str, list[MemorySubscription]] = {}
        for sub in self.subscriptions:
            if sub.consumer:
                continue  # taken below, through its consumer
            if matches(sub.pattern, delivery.subject):
                if sub.queue_group:
                    groups.setdefault(sub.queue_group, []).append(sub)
                else:
                    plain.append(sub)
        chosen = plain + [members[next(self._turn) % len(members)] for members in groups.values()]
        for sub in chosen:
            sub.push(delivery)
        consumers = [c for c in self.consumers.values() if matches(c.pattern, delivery.subject)]
        for consumer in consumers:
            consumer.take(delivery)
        return bool(chosen or consumers)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until nothing is queued or being handled (handlers may publish more)."""
        async with asyncio.timeout(timeout_s):
            while any(sub.pending for sub in self.subscriptions):
                await asyncio.sleep(0)

    async def close(self) -> None:
        for sub in list(self.subscriptions):
            await sub.unsubscribe()

    def _add(
        self,
        pattern: str,
        queue_group: str,
        callback: Callable[[Any], Awaitable[object]],
        consumer: str = "",
    ) -> MemorySubscription:
        sub = MemorySubscription(self, pattern, queue_group, callback, consumer)
        sub.task = asyncio.create_task(sub.run())
        self.subscriptions.append(sub)
        return sub
