"""A test's connection to a real nats-server as one of the cluster's users, keeping the
errors the server sends it, so that a refusal is asserted by what the server said."""

from __future__ import annotations

from collections.abc import Awaitable

import pytest
from nats.aio.client import Client as NatsClient

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.runtime.nats_private import connected
from tests.waiting import wait_until

REFUSED = "permissions violation"


class Connection:
    """A connection as one user (its own inbox prefix, as the services connect)."""

    def __init__(self, access: AccessControl) -> None:
        self.access = access
        self.errors: list[str] = []

    async def open(self, server: NatsServer, user: str) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc).lower())

        self.nc = await connected(
            self.access.nats_url(server.url, user),
            inbox_prefix=f"_INBOX_{user}",
            allow_reconnect=False,
            error_cb=on_error,
        )
        return self.nc

    async def refused(
        self, subject: str, attempt: Awaitable[object] | None = None, *, prefix: bool = False
    ) -> None:
        """``attempt`` fails (JetStream's API answers nothing to a refused request: it times
        out) and the server said why: a permission violation naming ``subject`` (with
        ``prefix``, a subject that starts so)."""
        if attempt is not None:
            with pytest.raises(Exception):  # noqa: B017 - the refusal itself is asserted below
                await attempt
        await wait_until(lambda: self.said(subject, prefix), 10)

    def said(self, subject: str, prefix: bool = False) -> bool:
        named = f'"{subject.lower()}' + ("" if prefix else '"')
        return any(REFUSED in e and named in e for e in self.errors)
