"""Connecting to NATS: the servers a URL names, TLS, reconnects that are logged not raised,
closing that never raises, and the JetStream streams the contracts name, kept in as many
copies as the NATS cluster allows. ``libs/runtime/bus.py`` speaks the contracts over what this
connects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError, ServiceUnavailableError

from libs.contracts import STREAMS
from libs.runtime.nats_private import connected, server_info

log = logging.getLogger(__name__)


async def connect_nats(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    reconnected: Callable[[], Awaitable[None]] | None = None,
    ca_file: Path | None = None,
    inbox: str | None = None,
) -> NatsClient:
    """Connect with unlimited reconnects; connection changes are logged, never raised;
    ``reconnected`` runs after each reconnect (what was in flight may have been lost);
    ``ca_file``: connect over TLS, trusting only the server certificates it signed. ``url``
    may name several servers of a NATS cluster, comma-separated: any one that answers will
    do, and the client moves to another when it goes. ``inbox``: the prefix of this
    connection's reply subjects; default the user's own (``inbox_of``), the only replies its
    NATS user may read."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", extra={"error": repr(exc)})

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")
        if reconnected is not None:
            await reconnected()

    return await connected(  # its flush waits for what is queued: see OrderedClient
        server_list(url),
        name=name,
        inbox_prefix=inbox or inbox_of(user_of(url)),
        tls=tls_context(ca_file),
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )


def _not_eof_over_tls(record: logging.LogRecord) -> bool:
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def tls_context(ca_file: Path | None) -> ssl.SSLContext | None:
    """TLS trusting only server certificates ``ca_file`` signed; None: plain TCP."""
    if ca_file is None:
        return None
    # asyncio warns each time a TLS peer closes (nats-py's protocol asks to keep the socket
    # half-open, which TLS cannot): noise, not news, on every NATS connection over TLS.
    logging.getLogger("asyncio").addFilter(_not_eof_over_tls)
    return ssl.create_default_context(cafile=str(ca_file))


def inbox_of(user: str | None) -> str:
    """The prefix of ``user``'s reply subjects (``_INBOX_<user>``): its NATS grant names
    ``_INBOX_<user>.>`` instead of ``_INBOX.>``, so no user reads replies meant for another.
    Without a user (a server without accounts), nats-py's own ``_INBOX``."""
    return f"_INBOX_{user}" if user else "_INBOX"


def user_of(url: str) -> str | None:
    """The user a NATS URL connects as (its first server's), if it names one."""
    servers = server_list(url)
    return urlsplit(servers[0]).username if servers else None


def server_list(url: str) -> list[str]:
    """The servers a NATS URL names (several, comma-separated, for a NATS cluster)."""
    return [server.strip() for server in url.split(",") if server.strip()]


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


def copies(nc: NatsClient) -> int:
    """How many copies JetStream keeps of a stream or key-value bucket: three in a NATS
    cluster (any one server may go; a Tessera NATS cluster has three servers or more), one on
    a lone server."""
    return 3 if server_info(nc).get("cluster") else 1


async def ensure_streams(nc: NatsClient, timeout_s: float = 30.0) -> None:
    """Create (or update) the JetStream streams the contracts name. Idempotent. A NATS
    cluster's JetStream answers only once its servers have elected a leader (seconds after
    they start, or after one goes): until then this tries again, ``timeout_s`` at most."""
    deadline = time.monotonic() + timeout_s
    for stream in STREAMS:
        await ensure_stream(nc, stream, max(0.0, deadline - time.monotonic()))


async def ensure_stream(nc: NatsClient, stream: str, timeout_s: float = 30.0) -> None:
    """Create (or update) the one stream ``stream`` of ``STREAMS``, as ``ensure_streams`` does."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await js.add_stream(
                name=stream, subjects=list(STREAMS[stream]), num_replicas=copies(nc)
            )
            return
        except (ServiceUnavailableError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


#: How often a consumer whose stream is not there looks for it again (s), and how often it
#: says again that it waits (s).
STREAM_POLL_S = 0.25
STREAM_WAIT_SAID_S = 30.0
STREAM_NOT_FOUND = 10059  #: JetStream's error code


def may_administer(nc: NatsClient) -> bool:
    """Whether this connection may create streams: one that names no user is on a server
    without authorization, where every client may. A user of a cluster with access control
    may not unless granted (a device's user never is: ``libs/cluster/access.py``), and asking
    would only earn a permissions violation, so a connection as a user never tries."""
    url = nc.connected_url
    return url is not None and not url.username


async def keep_consumer(nc: NatsClient, stream: str, config: ConsumerConfig) -> None:
    """Create the pull consumer ``config`` names (``durable_name``) on ``stream``, or give an
    existing one ``config``'s acknowledgement settings. It is created by name and filter subject
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``): the only consumer a device's NATS
    user may create is its own, on its own subject.

    The stream may not be there yet: the scheduler creates the streams, and a worker may
    connect first. A connection that may create it (``may_administer``) does so, as the
    scheduler would; any other waits for it as long as it takes, saying what it waits for every
    ``STREAM_WAIT_SAID_S``. It never raises for a missing stream: a worker that exited would
    only be started again into the same wait."""
    durable = config.durable_name
    if durable is None:
        raise ValueError("a durable consumer is named (durable_name)")
    js = nc.jetstream()
    waiting_since: float | None = None
    said_at = 0.0
    have: ConsumerConfig | None = None
    while True:
        try:
            have = (await js.consumer_info(stream, durable)).config
            break
        except NotFoundError as exc:
            if exc.err_code != STREAM_NOT_FOUND:
                break  # the stream is there, the consumer not yet
        why = "the scheduler creates it: this connection's user may not"
        if may_administer(nc):
            try:
                await ensure_stream(nc, stream, STREAM_WAIT_SAID_S)
                log.info("created the JetStream stream", extra={"stream": stream})
                continue
            except (ServiceUnavailableError, nats.errors.TimeoutError) as exc:
                why = f"JetStream does not answer yet: {exc!r}"
        now = time.monotonic()
        if waiting_since is None or now - said_at >= STREAM_WAIT_SAID_S:
            waiting_since, said_at = waiting_since or now, now
            subjects = ", ".join(STREAMS.get(stream, ()))
            log.warning(
                f"waiting for the JetStream stream {stream} ({subjects}): {why}",
                extra={"stream": stream, "waited_s": round(now - waiting_since, 1)},
            )
        await asyncio.sleep(STREAM_POLL_S)
    if waiting_since is not None:
        log.info("the JetStream stream is there", extra={"stream": stream})
    if have is None:
        await js.add_consumer(stream, config=config)
    elif have.deliver_subject:  # a push consumer of an older release: made again, pulled
        await js.delete_consumer(stream, durable)
        await js.add_consumer(stream, config=config)
    elif (have.ack_wait, have.max_deliver) != (config.ack_wait, config.max_deliver):
        have.ack_wait, have.max_deliver = config.ack_wait, config.max_deliver
        await js.add_consumer(stream, config=have)  # updates what may change
