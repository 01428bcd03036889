"""The message bus: typed publish/subscribe/request over the contract channels.

``Bus`` is what a service's shell is handed: ``NatsBus`` over a real NATS connection in
production and integration tests, ``MemoryBus`` (``libs/runtime/memory_bus.py``) in the unit
tests of handlers. Both decode every message against its contract before a handler sees it,
count what fails through ``rejected``, and keep a subscription alive when a handler raises.
A durable consumer (``consume``) settles each message by the policy of ``libs/runtime/acks.py``
(ack, nak with a delay, term). The module-level functions do the same on a bare NATS client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import BaseModel

from libs.contracts import Channel, ContractError
from libs.runtime.acks import Delivery as Delivery  # where it was always imported from
from libs.runtime.acks import Redelivery, acknowledging
from libs.runtime.cancelling import stopping
from libs.runtime.nats_client import keep_consumer
from libs.runtime.tracing import processing, sending

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
N = TypeVar("N", bound=BaseModel)

#: The acknowledgement settings of a durable consumer unless it names its own.
SHARD_TASKS = Redelivery()

Rejected = Callable[[str, str, str], None]
"""Called as ``rejected(channel_name, reason, detail)`` for a message that fails its contract."""


Handler = Callable[[M, Any], Awaitable[None]]
"""``handler(message, delivery)``: ``delivery`` is a ``Delivery``."""

RawHandler = Callable[[Any], Awaitable[None]]
"""``handler(delivery)`` for bytes that are not a contract model (hidden-state frames)."""


class Unsubscribe(Protocol):
    async def unsubscribe(self) -> None: ...


class Bus(Protocol):
    """Typed messaging over the contract channels (``NatsBus``, ``MemoryBus``)."""

    async def publish(self, channel: Channel[M], message: M, **tokens: str) -> None: ...

    async def publish_durable(self, channel: Channel[M], message: M, **tokens: str) -> None:
        """Publish into the channel's JetStream stream: kept until its consumer takes it."""

    async def reply(self, subject: str, channel: Channel[M], message: M) -> None:
        """Answer a request at its reply subject."""

    async def subscribe(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        rejected: Rejected | None = None,
        queue: str = "",
        subject: str | None = None,
    ) -> Unsubscribe: ...

    async def request(
        self, channel: Channel[M], message: M, answer: Channel[N], timeout_s: float, **tokens: str
    ) -> N: ...

    async def ask(self, channel: Channel[M], message: M, timeout_s: float, **tokens: str) -> bool:
        """Send ``message`` as a request and wait for any answer (an acknowledgement): False
        when nobody answers in time."""

    async def consume(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        durable: str,
        subject: str | None = None,
        rejected: Rejected | None = None,
        redelivery: Redelivery = SHARD_TASKS,
    ) -> Unsubscribe:
        """Take ``channel``'s durable messages (``publish_durable``) through the consumer named
        ``durable``: what is published after it was first created reaches it, also while its
        process was away, one message after another. Each is settled by the policy of
        ``libs/runtime/acks.py``: acknowledged once ``handler`` returns, delivered again after
        a transient failure (``redelivery`` bounds how often), dropped for good when it breaks
        its contract; ``handler`` gets a ``Received`` as its delivery."""

    async def publish_bytes(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Publish bytes that are not a contract model (a hidden-state frame, an empty
        acknowledgement at a reply subject)."""

    async def subscribe_bytes(self, subject: str, handler: RawHandler) -> Unsubscribe:
        """``handler(delivery)`` for each message on ``subject``, its bytes undecoded; a handler
        that raises is logged and the subscription carries on."""

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once what was published has reached the server (a round trip)."""


class NatsBus:
    """``Bus`` over a NATS connection (``connect_nats``); ``nc`` stays reachable for what
    only NATS has (key-value buckets, stream set-up)."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def publish(self, channel: Channel[M], message: M, **tokens: str) -> None:
        await publish(self.nc, channel, message, **tokens)

    async def publish_durable(self, channel: Channel[M], message: M, **tokens: str) -> None:
        await self.nc.jetstream().publish(channel.subject(**tokens), channel.encode(message))

    async def reply(self, subject: str, channel: Channel[M], message: M) -> None:
        await self.nc.publish(subject, channel.encode(message))

    async def subscribe(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        rejected: Rejected | None = None,
        queue: str = "",
        subject: str | None = None,
    ) -> Unsubscribe:
        return await subscribe(
            self.nc,
            channel,
            handler,
            rejected=rejected,
            queue=queue,
            subject=subject,
            pending_msgs_limit=1_000_000,
        )

    async def request(
        self, channel: Channel[M], message: M, answer: Channel[N], timeout_s: float, **tokens: str
    ) -> N:
        return await request(self.nc, channel, message, answer, timeout_s, **tokens)

    async def ask(self, channel: Channel[M], message: M, timeout_s: float, **tokens: str) -> bool:
        subject = channel.subject(**tokens)
        with sending(channel.name, subject) as headers:
            try:
                await self.nc.request(
                    subject, channel.encode(message), timeout=timeout_s, headers=headers
                )
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return False
        return True

    async def consume(
        self,
        channel: Channel[M],
        handler: Handler[M],
        *,
        durable: str,
        subject: str | None = None,
        rejected: Rejected | None = None,
        redelivery: Redelivery = SHARD_TASKS,
    ) -> Unsubscribe:
        on_msg = acknowledging(
            channel.name, lambda msg: decoded(channel, msg, rejected), handler, redelivery
        )
        if channel.stream is None:
            raise ValueError(f"{channel.name} is kept in no stream: subscribe to it instead")
        js = self.nc.jetstream()
        config = ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subject or channel.wildcard,
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=redelivery.ack_wait_s,
            max_deliver=redelivery.max_deliver,
        )
        await keep_consumer(self.nc, channel.stream, config)
        return Pulling(await js.pull_subscribe_bind(durable, channel.stream), on_msg)

    async def publish_bytes(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        await self.nc.publish(subject, data, headers=dict(headers) if headers else None)

    async def subscribe_bytes(self, subject: str, handler: RawHandler) -> Unsubscribe:
        return await self.nc.subscribe(subject, cb=guarded(subject, handler))

    async def flush(self, timeout_s: float = 5.0) -> None:
        await self.nc.flush(timeout=max(1, round(timeout_s)))


async def publish(nc: NatsClient, channel: Channel[M], message: M, **tokens: str) -> None:
    """Publish ``message``; inside a traced operation its context travels in the headers."""
    subject = channel.subject(**tokens)
    with sending(channel.name, subject) as headers:
        await nc.publish(subject, channel.encode(message), headers=headers)


async def request(
    nc: NatsClient,
    channel: Channel[M],
    message: M,
    answer: Channel[N],
    timeout_s: float,
    **tokens: str,
) -> N:
    """Send ``message`` and wait for one reply in ``answer``'s model (traced like ``publish``).
    Raises ``TimeoutError`` when nobody answers in time."""
    subject = channel.subject(**tokens)
    with sending(channel.name, subject) as headers:
        try:
            reply = await nc.request(
                subject, channel.encode(message), timeout=timeout_s, headers=headers
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise TimeoutError(f"no answer on {subject} within {timeout_s} s") from exc
    return answer.decode(reply.data)


class RateLimitedLog:
    """At most ``burst`` log lines per key per ``window_s``; the rest are counted and summed
    into the next line, so a flood of bad input cannot flood the log."""

    def __init__(self, window_s: float = 10.0, burst: int = 5) -> None:
        self.window_s, self.burst = window_s, burst
        self._windows: dict[tuple[str, str], tuple[float, int, int]] = {}

    def warning(self, key: tuple[str, str], message: str, **extra: object) -> None:
        now = time.monotonic()
        start, shown, hidden = self._windows.get(key, (now, 0, 0))
        if now - start > self.window_s:
            start, shown, hidden = now, 0, hidden
        if shown < self.burst:
            log.warning(message, extra={**extra, "suppressed_before": hidden})
            self._windows[key] = (start, shown + 1, 0)
        else:
            self._windows[key] = (start, shown, hidden + 1)


_rejection_log = RateLimitedLog()


async def subscribe(
    nc: NatsClient,
    channel: Channel[M],
    handler: Callable[[M, Msg], Awaitable[None]],
    *,
    rejected: Rejected | None = None,
    queue: str = "",
    subject: str | None = None,
    **sub_kwargs: Any,
) -> Subscription:
    """Subscribe to ``channel`` (its wildcard unless ``subject`` is given).

    Each message is decoded before ``handler`` sees it; one that fails its contract is counted
    through ``rejected`` and logged, and the subscription carries on. A handler that raises is
    logged with its traceback and does not stop the subscription either.
    """

    on_message = decoding(channel, handler, rejected)

    async def on_msg(msg: Msg) -> None:
        await on_message(msg)

    return await nc.subscribe(subject or channel.wildcard, queue=queue, cb=on_msg, **sub_kwargs)


def decoding(
    channel: Channel[M], handler: Handler[M], rejected: Rejected | None
) -> Callable[[Any], Awaitable[bool]]:
    """A raw-message callback that decodes against ``channel`` before calling ``handler``:
    a message that fails its contract is counted and logged (rate-limited), a handler that
    raises is logged with its traceback; neither stops the subscription. It returns whether
    the message kept its contract."""

    async def on_message(msg: Delivery) -> bool:
        message = decoded(channel, msg, rejected)
        if message is None:
            return False
        with processing(channel.name, msg.subject, msg.headers):
            try:
                await handler(message, msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler failed", extra={"channel": channel.name})
        return True

    return on_message


def decoded(channel: Channel[M], msg: Delivery, rejected: Rejected | None) -> M | None:
    """``msg`` decoded against ``channel``; None when it breaks its contract, which is counted
    through ``rejected`` and logged (rate-limited)."""
    try:
        return channel.decode(msg.data)
    except ContractError as exc:
        if rejected is not None:
            rejected(channel.name, exc.reason, exc.detail)
        _rejection_log.warning(
            (channel.name, exc.reason),
            "rejected message",
            channel=channel.name,
            reason=exc.reason,
            detail=exc.detail[:300],
        )
        return None


#: How long a pull waits for a message before it asks again (seconds): also how soon a
#: consumer asks again after its connection came back.
PULL_WAIT_S = 1.0


class Pulling:
    """A pull consumer's messages handed to ``on_msg`` one after another, as a push
    subscription would (a device's user may ask only for its own consumer's next message:
    ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``, with the reply in its own inbox)."""

    def __init__(self, sub: Any, on_msg: Callable[[Any], Awaitable[None]]) -> None:
        self.sub, self.on_msg = sub, on_msg
        self._task = asyncio.create_task(self._pull())

    async def _pull(self) -> None:
        while not stopping():
            try:
                msgs = await self.sub.fetch(1, timeout=PULL_WAIT_S)
            except nats.errors.TimeoutError:
                continue  # nothing came (or the connection is away): ask again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection closing, a server error
                log.info("pull failed", extra={"error": repr(exc)})
                await asyncio.sleep(PULL_WAIT_S)
                continue
            for msg in msgs:
                await self.on_msg(msg)

    async def unsubscribe(self) -> None:
        """Stop pulling; a message whose handler is cancelled is delivered again later."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


def guarded(subject: str, handler: RawHandler) -> RawHandler:
    """``handler`` that logs what it raises instead of ending the subscription."""

    async def on_message(delivery: Any) -> None:
        try:
            await handler(delivery)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed", extra={"subject": subject})

    return on_message
