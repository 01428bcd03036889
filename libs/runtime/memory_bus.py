"""``MemoryBus``: the ``Bus`` in one process, for unit tests of a service's handlers.

Subjects, wildcards (``*`` one token, ``>`` the rest), queue groups (each message to one
member) and request/reply behave as on NATS; every message is encoded and decoded through its
channel, so a handler sees exactly what it would over the wire, and a malformed one is
rejected the same way. Each subscription has its own queue and task, so delivery is
asynchronous and in order, as on NATS; ``settle()`` waits until every queue is empty and
every handler has returned.

It is no kinder than the server. A plain subscription sees only what is published while it
exists (a durable publish included: nothing stored is replayed to it). What the streams
(``STREAMS``) capture reaches durable consumers (``consume``) as JetStream delivers it: a new
consumer starts at the stream's end (``DeliverPolicy.NEW``), one whose subscriber went away
resumes where it stopped, and every message is settled by ``libs/runtime/acks.py``'s policy,
or delivered again when its ack wait passes, up to ``max_deliver`` times. Nothing here touches
the network. The subscriptions and consumers it delivers to are in
``libs/runtime/memory_subscriptions.py``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from libs.contracts import STREAMS, Channel
from libs.runtime.acks import Redelivery, Settleable, acknowledging
from libs.runtime.bus import (
    SHARD_TASKS,
    Handler,
    RawHandler,
    Rejected,
    decoded,
    decoding,
    guarded,
)
from libs.runtime.memory_subscriptions import (
    MemoryConsumer,
    MemoryDelivery,
    MemorySubscription,
    matches,
)

M = TypeVar("M", bound=BaseModel)
N = TypeVar("N", bound=BaseModel)


def captured(subject: str) -> bool:
    """Whether a JetStream stream (``STREAMS``) keeps what is published on ``subject``."""
    return any(matches(p, subject) for patterns in STREAMS.values() for p in patterns)


class MemoryBus:
    def __init__(self) -> None:
        self.subscriptions: list[MemorySubscription] = []
        self.consumers: dict[str, MemoryConsumer] = {}
        #: Every subject published, in order (what a test asserts was sent).
        self.published: list[MemoryDelivery] = []
        #: What the streams (``STREAMS``) captured, in order: the durable consumers' source.
        self.stream: list[MemoryDelivery] = []
        self._turn = itertools.count()
        self._inboxes = itertools.count()

    # -- Bus -----------------------------------------------------------------------------------
    async def publish(self, channel: Channel[M], message: M, **tokens: str) -> None:
        self.deliver(MemoryDelivery(channel.subject(**tokens), channel.encode(message)))

    async def publish_durable(self, channel: Channel[M], message: M, **tokens: str) -> None:
        subject = channel.subject(**tokens)
        if not captured(subject):
            raise TimeoutError(f"no stream takes {subject}")  # as JetStream: no responders
        self.deliver(MemoryDelivery(subject, channel.encode(message)))

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
        return self._add(subject or channel.wildcard, queue, decoding(channel, handler, rejected))

    async def consume(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        durable: str,
        subject: str | None = None,
        rejected: Rejected | None = None,
        redelivery: Redelivery = SHARD_TASKS,
    ) -> MemorySubscription:
        pattern = subject or channel.wildcard
        consumer = self.consumers.get(durable)
        if consumer is None:  # DeliverPolicy.NEW: from the stream's end on
            consumer = MemoryConsumer(self, pattern, redelivery, len(self.stream))
            self.consumers[durable] = consumer
        if consumer.bound:
            raise RuntimeError(f"consumer {durable} is already bound to a subscription")
        consumer.redelivery = redelivery  # as NatsBus updates an existing consumer's settings

        def decode(msg: Settleable) -> M | None:
            return decoded(channel, msg, rejected)

        on_msg = acknowledging(channel.name, decode, handler, redelivery)
        consumer.sub = self._add(pattern, "", on_msg, durable)
        consumer.pump()
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
        stored = captured(delivery.subject)
        if stored:  # a stream takes it, however it was published (as JetStream does)
            self.stream.append(delivery)
            for consumer in self.consumers.values():
                consumer.pump()
        return bool(chosen or stored)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until nothing is queued or being handled (handlers may publish more). What is
        due later (a redelivery after a nak's delay or an ack wait, work a consumer's handler
        left running) is not waited for."""
        async with asyncio.timeout(timeout_s):
            while any(sub.pending for sub in self.subscriptions):
                await asyncio.sleep(0)

    def unsettled(self, durable: str) -> int:
        """Messages consumer ``durable`` delivered and has not had settled yet (JetStream's
        ``num_ack_pending``): while it is above 0, something may be delivered again."""
        consumer = self.consumers.get(durable)
        return len(consumer.unsettled) if consumer is not None else 0

    async def close(self) -> None:
        for sub in list(self.subscriptions):
            await sub.unsubscribe()
        for consumer in self.consumers.values():
            consumer.close()

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
