"""Every private attribute of nats-py that Tessera reads, behind one function each.

nats-py offers no public way to get these, and Tessera needs them:

* the connection a JetStream context runs on (``JetStreamContext._nc``): the weights' bulk
  reader opens a second connection as the same user;
* the connection's NUID generator (``Client._nuid``): an object store chunk subject named as
  nats-py's own object store names it;
* what the server said in its INFO (``Client._server_info``): whether it is part of a NATS
  cluster, whether it requires TLS;
* the CONNECT line the connection sends and its nonce signer (``Client._connect_command``,
  ``Client._signature_cb``): the bulk reader logs in with the same credentials, whatever their
  kind (user and password, token, a signed nonce);
* what the connection still holds for its flusher task (``Client._pending_data_size``,
  ``Client._flush_pending``): ``OrderedClient.flush`` writes it before its PING.

A private attribute may change in any release, so nowhere else reads one (a test of the
architecture fails where another file does), and ``tests/integration/test_nats_private.py``
exercises each against a real nats-server on the installed nats-py, which must be one of
``WRITTEN_FOR`` (``pyproject.toml`` pins that range). Moving to another nats-py release:
run that test, mend what fails here, then widen ``WRITTEN_FOR`` and the pin together.
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

#: The nats-py releases (major.minor) whose private attributes this module was checked against.
WRITTEN_FOR = ("2.16",)


def client_of(js: JetStreamContext) -> NatsClient:
    """The connection a JetStream context sends on."""
    client: NatsClient = js._nc
    return client


def next_nuid(nc: NatsClient) -> str:
    """A fresh NUID from the connection's own generator (22 characters, ``[0-9A-Za-z]``), as
    nats-py's object store names an object's chunk subject."""
    return str(nc._nuid.next().decode())


def server_info(nc: NatsClient) -> dict[str, Any]:
    """A copy of the INFO of the server the connection is on ({} before it first connects):
    ``cluster`` where that server is part of a NATS cluster, ``tls_required``, ``nonce``…"""
    info = getattr(nc, "_server_info", None) or {}
    return dict(info)


def connect_options(nc: NatsClient, nonce: str | None) -> dict[str, Any]:
    """The options of the CONNECT the connection sends (its credentials, whatever their kind),
    for another connection as the same user: where it signs a nonce, ``sig`` is the signature
    of ``nonce`` (the one that other connection's server sent), not of the connection's own."""
    options: dict[str, Any] = json.loads(nc._connect_command().partition(b" ")[2])
    signer = nc._signature_cb
    if "sig" in options and signer is not None and nonce is not None:
        options["sig"] = signer(nonce).decode()
    return options


class OrderedClient(NatsClient):
    """nats-py's client whose ``flush`` returns only once the server has read everything sent
    before it. nats-py's own writes its PING straight to the socket, ahead of the SUBs and PUBs
    still queued for its flusher task: its PONG could come back before the server held a
    subscription just made (seen: a device's publish, sent after the PONG, reached no one).
    Every connection Tessera opens is one of these (``connected``)."""

    async def flush(self, timeout: int = 10) -> None:
        if self.is_connected and self._pending_data_size > 0:
            await self._flush_pending(force_flush=True)  # queued commands onto the socket first
        await super().flush(timeout)


async def connected(servers: str | list[str], **options: Any) -> OrderedClient:
    """``nats.connect``, but the client is an ``OrderedClient``."""
    nc = OrderedClient()
    await nc.connect(servers, **options)
    return nc
