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
from nats.js.errors import ServiceUnavailableError

from libs.contracts import STREAMS
from libs.runtime.nats_private import server_info

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

    return await nats.connect(
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
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    for stream, subjects in STREAMS.items():
        while True:
            try:
                await js.add_stream(name=stream, subjects=list(subjects), num_replicas=copies(nc))
                break
            except (ServiceUnavailableError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
