"""The deployment book: every deployment, as one immutable value folded from indexed events.

``apply(book, change)`` is the only way a book changes: it returns a new book one index
further. The scheduler, the one writer, turns each command into changes (``record``) and
publishes them as ``DeploymentEvent``s; every follower (the gateway's routes, the dashboard,
the CLI) applies the same events with ``follow``, which says when one is missing so the
follower takes a snapshot instead. A checkpoint is the book; restoring one replaces the book.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import libs.deployments.phases as phases
from libs.contracts import (
    DeploymentChange,
    DeploymentEvent,
    DeploymentMeasured,
    DeploymentPlanned,
    DeploymentRemoved,
    DeploymentsSnapshot,
    DeploymentState,
    DeploymentStopped,
    ShardReported,
)

#: A book no leader has written yet (a follower before its first snapshot).
NO_TERM = "none"


def _frozen(items: Iterable[DeploymentState]) -> Mapping[str, DeploymentState]:
    return MappingProxyType({d.deployment_id: d for d in items})


@dataclass(frozen=True)
class DeploymentBook:
    """Every deployment after the events up to ``index`` of ``term``."""

    term: str = NO_TERM
    index: int = 0
    by_id: Mapping[str, DeploymentState] = field(default_factory=lambda: _frozen(()))

    def get(self, deployment_id: str) -> DeploymentState | None:
        return self.by_id.get(deployment_id)

    def __contains__(self, deployment_id: object) -> bool:
        return deployment_id in self.by_id

    def __iter__(self) -> Iterator[DeploymentState]:
        """The deployments in the order of their ids."""
        return iter(sorted(self.by_id.values(), key=lambda d: d.deployment_id))

    def __len__(self) -> int:
        return len(self.by_id)

    def group(self, base: str) -> list[DeploymentState]:
        """Deployment ``base`` and its replicas, by id."""
        return [d for d in self if base in (d.deployment_id, d.replica_of)]

    def live(self) -> list[DeploymentState]:
        """The deployments not stopped (refused or failed)."""
        return [d for d in self if d.phase not in phases.FINAL]

    def reserved_gb(self, without: str | None = None, vram: bool = False) -> dict[str, float]:
        """GB of host memory (or, ``vram``, of GPU memory) the deployments (all, or all but
        ``without``) hold on each device; a stopped one holds none (its shards were unloaded)."""
        reserved: dict[str, float] = {}
        for deployment in self.live():
            if deployment.deployment_id == without:
                continue
            for a in deployment.assignments:
                held = a.vram_gb if vram else a.memory_gb
                reserved[a.device_id] = reserved.get(a.device_id, 0.0) + held
        return reserved

    def snapshot(self, ts: float) -> DeploymentsSnapshot:
        return DeploymentsSnapshot(term=self.term, index=self.index, ts=ts, deployments=tuple(self))

    @classmethod
    def of(cls, snapshot: DeploymentsSnapshot) -> DeploymentBook:
        return cls(snapshot.term, snapshot.index, _frozen(snapshot.deployments))

    @classmethod
    def holding(
        cls, deployments: Iterable[DeploymentState], index: int = 0, term: str = NO_TERM
    ) -> DeploymentBook:
        """A book of ``deployments`` as the events up to ``index`` left them (a checkpoint)."""
        return cls(term, index, _frozen(deployments))

    def restored(self, term: str) -> DeploymentBook:
        """The same deployments under a new leader's ``term``, numbered on from here."""
        return DeploymentBook(term, self.index, self.by_id)


def apply(book: DeploymentBook, change: DeploymentChange) -> DeploymentBook:
    """``book`` after ``change``, one index further. A change about a deployment the book
    does not hold (a report after a removal, say) changes nothing but the index."""
    items = dict(book.by_id)
    if isinstance(change, DeploymentPlanned):
        items[change.deployment.deployment_id] = change.deployment
    elif isinstance(change, ShardReported):
        known = items.get(change.deployment_id)
        updated = None if known is None else phases.report(known, change.epoch, change.shard)
        if updated is not None:
            items[change.deployment_id] = updated
    elif isinstance(change, DeploymentStopped):
        known = items.get(change.deployment_id)
        if known is not None:
            items[change.deployment_id] = known.model_copy(
                update={
                    "phase": change.phase,
                    "reason": change.reason,
                    "refused_by": change.refused_by,
                }
            )
    elif isinstance(change, DeploymentRemoved):
        items.pop(change.deployment_id, None)
    elif isinstance(change, DeploymentMeasured):
        known = items.get(change.deployment_id)
        if known is not None and known.epoch == change.epoch:  # another plan's: stale
            items[change.deployment_id] = known.model_copy(update={"measured": change.measured})
    return DeploymentBook(book.term, book.index + 1, MappingProxyType(items))


def record(
    book: DeploymentBook, changes: Iterable[DeploymentChange], ts: float
) -> tuple[DeploymentBook, list[DeploymentEvent]]:
    """The writer's side: apply ``changes`` in order and number them as events."""
    events = []
    for change in changes:
        book = apply(book, change)
        events.append(DeploymentEvent(term=book.term, index=book.index, ts=ts, change=change))
    return book, events


Followed = Literal["applied", "old", "missing"]


def follow(book: DeploymentBook, event: DeploymentEvent) -> tuple[DeploymentBook, Followed]:
    """A follower's side: ``event`` applied when it is the next one (``applied``); ignored
    when the book already holds it (``old``); ``missing`` when events were missed or a new
    leader's term began: the book is unchanged, and the follower needs a snapshot."""
    if event.term == book.term and event.index == book.index + 1:
        return apply(book, event.change), "applied"
    if event.term == book.term and event.index <= book.index:
        return book, "old"
    return book, "missing"
