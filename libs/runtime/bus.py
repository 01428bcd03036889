"""NATS connections and typed publish/subscribe over the contract channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from libs.contracts import STREAMS, Channel, ContractError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

Rejected = Callable[[str, str, str], None]
"""Called as ``rejected(channel_name, reason, detail)`` for a message that fails its contract."""


async def connect_nats(url: str, name: str, *, connect_timeout_s: float = 5.0) -> NatsClient:
    """Connect with unlimited reconnects; connection changes are logged, never raised."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", extra={"error": repr(exc)})

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    return await nats.connect(
        url,
        name=name,
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


async def close_nats(nc: NatsClient) -> None:
    """Drain if connected (delivering what is pending), else just close; never raises."""
    try:
        if nc.is_connected:
            await nc.drain()
        else:
            await nc.close()
    except Exception as exc:
        log.info("nats close", extra={"error": repr(exc)})
        with contextlib.suppress(Exception):
            await nc.close()


async def ensure_streams(nc: NatsClient) -> None:
    """Create (or update) the JetStream streams the contracts name. Idempotent."""
    js = nc.jetstream()
    for stream, subjects in STREAMS.items():
        await js.add_stream(name=stream, subjects=list(subjects))


async def publish(nc: NatsClient, channel: Channel[M], message: M, **tokens: str) -> None:
    await nc.publish(channel.subject(**tokens), channel.encode(message))


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

    async def on_message(msg: Msg) -> None:
        try:
            message = channel.decode(msg.data)
        except ContractError as exc:
            if rejected is not None:
                rejected(channel.name, exc.reason, exc.detail)
            log.warning(
                "rejected message",
                extra={"channel": channel.name, "reason": exc.reason, "detail": exc.detail},
            )
            return
        try:
            await handler(message, msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed", extra={"channel": channel.name})

    return await nc.subscribe(subject or channel.wildcard, queue=queue, cb=on_message, **sub_kwargs)
