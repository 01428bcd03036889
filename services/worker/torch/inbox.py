"""What arrives for a torch worker's shard engines, before its compute loop takes it.

New requests, hidden-state frames, cancels and expiries are queued in arrival order; the compute
loop applies them between steps, so an engine's state changes only there. Work for a shard that
is still loading (a newer epoch) is parked, not lost, until it loads or ``park_s`` passes; work
for an older epoch is dropped (its owner re-runs it), and so is a frame from a device that is
not on the deployment's route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from libs.contracts import HIDDEN, ContractError, Frame, GenerationRequest, StepRow
from services.worker.torch.shard_engine import ShardEngine


@dataclass(frozen=True)
class Item:
    """One step of work for a deployment's shard at one epoch."""

    deployment_id: str
    epoch: int
    request: GenerationRequest | None = None
    frame: Frame | None = None
    rows: list[StepRow] = dataclasses.field(default_factory=list)  #: the frame's
    parked_at: float = 0.0
    #: The trace context it came with (a new request, a prefill frame); None when untraced.
    headers: dict[str, str] | None = None
    #: The device a frame came from (None: this worker's own work): taken only when it is a
    #: device of the deployment's route at the frame's epoch.
    sender: str | None = None


@dataclass(frozen=True)
class Cancel:
    """Drop a request from a deployment's engine (queued: applied between steps)."""

    deployment_id: str
    request_id: str


@dataclass(frozen=True)
class Expire:
    """Drop the requests idle for ``idle_s`` from every engine (queued like ``Cancel``)."""

    idle_s: float


class Inbox:
    """The queue the compute loop takes from, the parked work, and the requests cancelled
    (by id, with when: a frame or a re-run of one that arrives later is dropped)."""

    def __init__(self, park_s: float, refuse: Callable[[str, ContractError], None]) -> None:
        self.park_s = park_s
        #: Counts and logs a message that broke its contract (the worker's ``refuse``).
        self.refuse = refuse
        self.queue: asyncio.Queue[Item | Cancel | Expire] = asyncio.Queue()
        self.parked: list[Item] = []
        self.cancelled: dict[str, float] = {}

    @property
    def depth(self) -> int:
        """Work waiting to run or parked."""
        return self.queue.qsize() + len(self.parked)

    def accept(self, item: Item, engine: ShardEngine | None) -> None:
        """Queue ``item`` for ``engine`` (its deployment's, None while none is loaded): parked
        when no engine of its epoch runs yet, dropped when it is for an older one."""
        if engine is None or item.epoch > engine.epoch:
            self.parked.append(dataclasses.replace(item, parked_at=time.monotonic()))
        elif item.epoch == engine.epoch and self.from_route(item, engine.route):
            self.queue.put_nowait(item)

    def unpark(self, deployment_id: str, engine: ShardEngine) -> None:
        """Queue the parked work of ``deployment_id`` that ``engine`` (just loaded) runs."""
        keep: list[Item] = []
        for item in self.parked:
            if item.deployment_id != deployment_id or item.epoch > engine.epoch:
                keep.append(item)
            elif item.epoch == engine.epoch and self.from_route(item, engine.route):
                self.queue.put_nowait(item)
        self.parked = keep

    def from_route(self, item: Item, route: tuple[str, ...]) -> bool:
        """Whether a frame came from a device of the deployment's route (a device that serves
        nothing of it cannot write into its pipeline); this worker's own work always does."""
        if item.sender is None or item.sender in route:
            return True
        detail = f"a frame from {item.sender}, not a device of {item.deployment_id}"
        self.refuse(HIDDEN.name, ContractError("not_routed", detail))
        return False

    def cancel(self, request_id: str) -> None:
        self.cancelled[request_id] = time.monotonic()

    def expire(self, idle_s: float) -> list[Item]:
        """Take out the work parked longer than ``park_s`` (returned: nobody loaded a shard
        for it) and forget cancels older than ``idle_s``."""
        now = time.monotonic()
        stale = [i for i in self.parked if now - i.parked_at > self.park_s]
        self.parked = [i for i in self.parked if now - i.parked_at <= self.park_s]
        self.cancelled = {r: t for r, t in self.cancelled.items() if now - t < idle_s}
        return stale
