"""Following the scheduler's deployment book over NATS: the gateway's routes, the dashboard,
and tests that watch deployments.

``BookFollower`` applies each ``DeploymentEvent`` in order (``libs.deployments.follow``). When
one is missing (a message lost over a reconnect) or a new leader's term begins, it takes the
whole book again: from ``fetch`` (the scheduler's ``GET /deployments``) where it has one, and
from the snapshot the scheduler publishes every 15 s either way. Whoever needs to act on a
change registers ``on_change(before, after)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from libs.contracts import (
    DEPLOYMENT_EVENT,
    DEPLOYMENTS_SNAPSHOT,
    DeploymentEvent,
    DeploymentsSnapshot,
)
from libs.deployments import DeploymentBook, follow
from libs.runtime.bus import Bus, Delivery, Rejected, Unsubscribe

log = logging.getLogger(__name__)

Fetch = Callable[[], Awaitable[DeploymentsSnapshot]]
Changed = Callable[[DeploymentBook, DeploymentBook], None]


class BookFollower:
    def __init__(self, fetch: Fetch | None = None) -> None:
        self.book = DeploymentBook()
        self.fetch = fetch
        self._changed: list[Changed] = []
        self._fetching: asyncio.Task[None] | None = None
        #: Snapshots taken because events were missing (a metric for the curious).
        self.catch_ups = 0

    def on_change(self, changed: Changed) -> None:
        """Call ``changed(before, after)`` after each change of the book."""
        self._changed.append(changed)

    def _set(self, book: DeploymentBook) -> None:
        before, self.book = self.book, book
        for changed in self._changed:
            changed(before, book)

    def take(self, snapshot: DeploymentsSnapshot) -> None:
        """The whole book: taken unless it is older than what this follower holds."""
        if snapshot.term == self.book.term and snapshot.index < self.book.index:
            return
        self._set(DeploymentBook.of(snapshot))

    def receive(self, event: DeploymentEvent) -> None:
        book, followed = follow(self.book, event)
        if followed == "applied":
            self._set(book)
        elif followed == "missing":
            self.catch_up_soon()

    def catch_up_soon(self) -> None:
        """Take the whole book from ``fetch`` (once at a time); without one, the next
        published snapshot does it."""
        if self.fetch is None or (self._fetching is not None and not self._fetching.done()):
            return
        self._fetching = asyncio.create_task(self.catch_up())

    async def catch_up(self) -> None:
        if self.fetch is None:
            return
        try:
            snapshot = await self.fetch()
        except Exception as exc:  # the published snapshot comes within 15 s anyway
            log.warning("deployments not fetched", extra={"error": repr(exc)})
            return
        self.catch_ups += 1
        self.take(snapshot)

    async def watch(self, bus: Bus, rejected: Rejected | None = None) -> list[Unsubscribe]:
        """Follow the book's events and snapshots; returns the subscriptions."""

        async def on_event(event: DeploymentEvent, msg: Delivery) -> None:
            self.receive(event)

        async def on_snapshot(snapshot: DeploymentsSnapshot, msg: Delivery) -> None:
            self.take(snapshot)

        return [
            await bus.subscribe(DEPLOYMENTS_SNAPSHOT, on_snapshot, rejected=rejected),
            await bus.subscribe(DEPLOYMENT_EVENT, on_event, rejected=rejected),
        ]

    async def close(self) -> None:
        if self._fetching is not None:
            self._fetching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fetching
