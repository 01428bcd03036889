"""Acknowledgement as policy: how a durable consumer (``Bus.consume``) settles each message.

The same on NATS JetStream (``NatsBus``) and in memory (``MemoryBus``):

- the handler returns: **ack**, the message is done and never delivered again;
- the message breaks its contract, or the handler raises ``ContractError`` (the message can
  never be handled, whoever tries): **term**, it is not delivered again;
- the handler raises anything else (a transient failure: a connection down, a peer away):
  **nak** with a delay of ``retry_delay_s``, it is delivered again, ``max_deliver`` times in
  all; the last failure is **term**ed and logged, so a poison message does not loop forever;
- the handler is cancelled (its consumer closed, its process stopping): nothing, so the server
  delivers it again once ``ack_wait_s`` has passed (to this consumer's next subscriber).

While a handler runs, an in-progress ack every third of ``ack_wait_s`` keeps its message from
being delivered again, however long it takes. A handler whose work outlives it (an engine that
takes minutes to start) hands that work over with ``Received.settle_after(job)``: the consumer
goes on to its next message while this one is kept alive and then settled by how ``job`` ends,
by the rules above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from libs.contracts import ContractError
from libs.runtime.cancelling import stopping
from libs.runtime.tracing import processing

log = logging.getLogger(__name__)

#: Seconds a delivered message may go without an acknowledgement (or an in-progress ack)
#: before the server delivers it again: JetStream's default.
ACK_WAIT_S = 30.0
#: Deliveries of one message at most, the first included: a message whose handler keeps
#: failing is given up after this many.
MAX_DELIVER = 5
#: Seconds before a message whose handler failed is delivered again.
RETRY_DELAY_S = 2.0


@dataclass(frozen=True)
class Redelivery:
    """A durable consumer's acknowledgement settings (the defaults suit the shard tasks)."""

    ack_wait_s: float = ACK_WAIT_S
    max_deliver: int = MAX_DELIVER
    retry_delay_s: float = RETRY_DELAY_S

    @property
    def progress_every_s(self) -> float:
        """How often a message whose work goes on is marked in progress: three times per
        ``ack_wait_s``, so one lost in-progress ack does not let it be delivered again."""
        return self.ack_wait_s / 3


class Deliveries(Protocol):
    @property
    def num_delivered(self) -> int: ...


class Delivery(Protocol):
    """What a handler gets beside the decoded message (a NATS ``Msg`` is one)."""

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def reply(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str] | None: ...


class Settleable(Delivery, Protocol):
    """A message from a durable consumer (a JetStream ``Msg``; ``MemoryBus``'s imitates it)."""

    @property
    def metadata(self) -> Deliveries: ...

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


class Received:
    """What a consumer's handler gets beside its message: the ``Delivery`` fields, which
    delivery of the message this is (``attempt``, from 1), and ``settle_after``."""

    def __init__(self, msg: Settleable) -> None:
        self.msg = msg
        self.attempt = msg.metadata.num_delivered
        self.job: asyncio.Future[Any] | None = None

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def reply(self) -> str:
        return self.msg.reply

    @property
    def headers(self) -> Mapping[str, str] | None:
        return self.msg.headers

    def settle_after(self, job: asyncio.Future[Any]) -> None:
        """Settle this message by how ``job`` ends instead of when the handler returns; it is
        kept alive (in progress) until then, while the consumer takes its next messages."""
        self.job = job


Decode = Callable[[Settleable], Any]
"""Decodes a message's bytes; returns None for one that broke its contract (and reports it)."""


def acknowledging(
    channel_name: str,
    decode: Decode,
    handler: Callable[[Any, Received], Awaitable[None]],
    redelivery: Redelivery,
) -> Callable[[Settleable], Awaitable[None]]:
    """A durable consumer's message callback: decode, run ``handler`` with in-progress acks,
    settle by the policy above."""
    handed_over: set[asyncio.Task[None]] = set()  # settlers of work handlers left running

    async def on_msg(msg: Settleable) -> None:
        message = decode(msg)
        if message is None:
            await _safely(msg.term)  # broke its contract: delivering it again cannot help
            return
        received = Received(msg)
        with processing(channel_name, msg.subject, msg.headers):
            failure = await kept(msg, handler(message, received), redelivery)
        if received.job is not None and failure is None:
            settler = asyncio.create_task(settle_when_done(msg, received.job))
            handed_over.add(settler)
            settler.add_done_callback(handed_over.discard)
            return
        await settle(msg, failure, redelivery, channel_name)

    async def settle_when_done(msg: Settleable, job: asyncio.Future[Any]) -> None:
        failure = await kept(msg, asyncio.shield(job), redelivery)  # watch it, never cancel it
        await settle(msg, failure, redelivery, channel_name)

    return on_msg


async def kept(
    msg: Settleable, work: Awaitable[object], redelivery: Redelivery
) -> Exception | None:
    """Await ``work`` while marking ``msg`` in progress; returns what it raised (None when it
    returned). Cancellation (of ``work`` or of the caller) goes through."""
    beat = asyncio.create_task(_in_progress(msg, redelivery.progress_every_s))
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return exc
    finally:
        beat.cancel()
    return None


async def settle(
    msg: Settleable, failure: Exception | None, redelivery: Redelivery, channel_name: str
) -> None:
    """Ack, term or nak ``msg`` by how its handling ended (``failure``; None: it succeeded)."""
    attempt = msg.metadata.num_delivered
    where = {"channel": channel_name, "subject": msg.subject, "attempt": attempt}
    if failure is None:
        await _safely(msg.ack)
    elif isinstance(failure, ContractError):
        log.warning("handler refused the message for good", extra={**where, "error": str(failure)})
        await _safely(msg.term)
    elif attempt >= redelivery.max_deliver:
        log.error("handler failed; given up", extra=where, exc_info=failure)
        await _safely(msg.term)
    else:
        log.warning("handler failed; delivered again", extra=where, exc_info=failure)
        await _safely(lambda: msg.nak(redelivery.retry_delay_s))


async def _in_progress(msg: Settleable, every_s: float) -> None:
    while not stopping():
        await asyncio.sleep(every_s)
        await _safely(msg.in_progress)


async def _safely(settling: Callable[[], Awaitable[None]]) -> None:
    """Send an acknowledgement; one that cannot be sent (the connection is down) is logged: the
    server then delivers the message again after its ack wait, which is the safe side."""
    try:
        await settling()
    except Exception as exc:
        log.warning("acknowledgement not sent", extra={"error": repr(exc)})
