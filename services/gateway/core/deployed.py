"""What is deployed and where it runs, as the gateway knows it: the scheduler's deployment book
(``libs/deployments``), followed event by event (``libs/runtime/following.py``), and the
devices the scorer reports down.

The book is the one source: a deployment's route (its epoch and devices in shard order, once
it serves), its model, context and phase, and which deployment a model's name means (the one
rule, ``libs.deployments.resolve``) are all read from it. The scheduler's snapshot is asked for
at start and when an event is missing; nothing else writes the book, save a pipeline placed by
hand where no scheduler runs (``hold``: tests and benchmarks). Each change wakes the streams
that follow a deployment (``listen``), so they move with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from libs.contracts import (
    DEFAULT_CONTEXT_TOKENS,
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    DeploymentPlanned,
    DeploymentsSnapshot,
    DeploymentState,
    DeviceFailed,
    DeviceRecovered,
    PlacementDecision,
    ShardProgress,
    ShardTask,
    TokenChunk,
)
from libs.contracts.placement import Assignment
from libs.deployments import DeploymentBook, apply, resolve, serving_models
from libs.runtime.bus import Bus, Delivery, Rejected, Unsubscribe
from libs.runtime.following import BookFollower
from services.gateway.core.errors import ApiError
from services.gateway.core.schedulers import ask_scheduler


@dataclass(frozen=True)
class Route:
    deployment_id: str
    epoch: int
    devices: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.devices[0]

    @classmethod
    def of(cls, decision: PlacementDecision, deployment_id: str) -> Route:
        """The route of a placed decision for ``deployment_id`` (its ``deployment_id``: the
        deployment, or the replica a request was routed to)."""
        ordered = sorted(decision.assignments, key=lambda a: a.shard_index)
        return cls(deployment_id, decision.epoch, tuple(a.device_id for a in ordered))

    @classmethod
    def serving(cls, deployment: DeploymentState) -> Route:
        return cls(deployment.deployment_id, deployment.epoch, deployment.route)


class Moved:
    """Put in a stream's queue when its deployment's route changes."""


class Resend:
    """Put in a stream's queue when messages may have been lost (NATS reconnected)."""


#: What a stream waits on: its chunks, and news of its deployment.
Inbox = asyncio.Queue[TokenChunk | Moved | Resend]


def hand_placed(tasks: Sequence[ShardTask]) -> DeploymentState:
    """A pipeline placed by hand (``libs.harness.workers``) as the serving deployment its
    shard tasks make."""
    first = tasks[0]
    return DeploymentState(
        deployment_id=first.deployment_id,
        model=first.model,
        epoch=first.epoch,
        context_length=first.context_length or DEFAULT_CONTEXT_TOKENS,
        assignments=tuple(
            Assignment(
                device_id=t.device_id,
                shard_index=t.shard_index,
                layer_start=t.layer_start,
                layer_end=t.layer_end,
            )
            for t in tasks
        ),
        phase="serving",
        shards=tuple(
            ShardProgress(device_id=t.device_id, shard_index=t.shard_index, state="loaded")
            for t in tasks
        ),
    )


class Deployed:
    def __init__(self, scheduler_urls: Sequence[str] = ()) -> None:
        """``scheduler_urls``: where the book's snapshot is asked for (none: only the one the
        scheduler publishes every 15 s)."""
        self.scheduler_urls = list(scheduler_urls)
        self.follower = BookFollower(self.fetch if scheduler_urls else None)
        self.follower.on_change(self._changed)
        #: Devices the scorer reported failed and not recovered since.
        self.down: set[str] = set()
        #: Called with a model's name when a deployment of it serves or is first seen (the
        #: gateway warms its tokenizer).
        self.on_model: Callable[[str], None] = lambda model: None
        self._listeners: dict[str, set[Inbox]] = {}

    @property
    def book(self) -> DeploymentBook:
        return self.follower.book

    # -- following ------------------------------------------------------------------------------
    async def fetch(self) -> DeploymentsSnapshot:
        response = await ask_scheduler(self.scheduler_urls, "GET", "deployments", timeout_s=5.0)
        response.raise_for_status()
        return DeploymentsSnapshot.model_validate(response.json())

    async def catch_up(self) -> bool:
        """Take the scheduler's snapshot now; False when it does not answer."""
        try:
            self.follower.take(await self.fetch())
        except (httpx.HTTPError, ValueError):
            return False
        return True

    async def watch(self, bus: Bus, rejected: Rejected | None = None) -> list[Unsubscribe]:
        """Follow the book and device failures; returns the subscriptions."""

        async def on_failed(event: DeviceFailed, msg: Delivery) -> None:
            self.failed(event.device_id)

        async def on_recovered(event: DeviceRecovered, msg: Delivery) -> None:
            self.recovered(event.device_id)

        return [
            *await self.follower.watch(bus, rejected),
            await bus.subscribe(DEVICE_FAILED, on_failed, rejected=rejected),
            await bus.subscribe(DEVICE_RECOVERED, on_recovered, rejected=rejected),
        ]

    def hold(self, deployment: DeploymentState) -> None:
        """A deployment placed by hand, where no scheduler runs (tests, benchmarks)."""
        self.follower.take(apply(self.book, DeploymentPlanned(deployment=deployment)).snapshot(0.0))

    def _changed(self, before: DeploymentBook, after: DeploymentBook) -> None:
        """Wake the streams of each deployment that changed; warm the tokenizer of a model
        that serves or is new."""
        for deployment_id in set(before.by_id) | set(after.by_id):
            old, new = before.get(deployment_id), after.get(deployment_id)
            if old == new:
                continue
            fresh = new is not None and (old is None or new.phase == "serving")
            if fresh and new is not None and new.phase not in ("refused", "failed"):
                self.on_model(new.model)
            self._wake(deployment_id)

    # -- devices --------------------------------------------------------------------------------
    def failed(self, device_id: str) -> None:
        """A device failed: streams on it wait a little for the re-placement, or give up."""
        self.down.add(device_id)
        self._wake_on(device_id)

    def recovered(self, device_id: str) -> None:
        self.down.discard(device_id)
        self._wake_on(device_id)

    # -- streams --------------------------------------------------------------------------------
    def route(self, deployment_id: str) -> Route | None:
        """Where ``deployment_id`` runs, once it serves (None: not serving, or not known)."""
        deployment = self.book.get(deployment_id)
        if deployment is None or deployment.phase != "serving":
            return None
        return Route.serving(deployment)

    def loading(self, deployment_id: str) -> bool:
        """Whether its current plan still loads (a re-placed deployment: its streams wait
        for it to serve rather than give up)."""
        deployment = self.book.get(deployment_id)
        return deployment is not None and deployment.phase in ("pending", "loading")

    def listen(self, deployment_id: str, queue: Inbox) -> None:
        self._listeners.setdefault(deployment_id, set()).add(queue)

    def unlisten(self, deployment_id: str, queue: Inbox) -> None:
        self._listeners.get(deployment_id, set()).discard(queue)

    def resend_all(self) -> None:
        """Every stream asks again for what it has not received (after a reconnect)."""
        for queues in self._listeners.values():
            for queue in queues:
                queue.put_nowait(Resend())

    def _wake(self, deployment_id: str) -> None:
        for queue in self._listeners.get(deployment_id, ()):
            queue.put_nowait(Moved())

    def _wake_on(self, device_id: str) -> None:
        for deployment in self.book:
            if device_id in deployment.route:
                self._wake(deployment.deployment_id)

    # -- names ----------------------------------------------------------------------------------
    async def lookup(self, name: str) -> DeploymentState:
        """``resolve``, taking the scheduler's snapshot first when the name is not known yet
        (a deployment made a moment ago)."""
        if resolve(name, self.book) is None and self.scheduler_urls:
            await self.catch_up()
        return self.resolve(name)

    def resolve(self, name: str) -> DeploymentState:
        """The deployment ``name`` means (``libs.deployments.resolve``); a 404 when none does,
        or when it stopped (with its reason)."""
        found = resolve(name, self.book)
        if found is None:
            known = ", ".join(self.listed) or "none"
            raise ApiError(
                404, f"model {name!r} is not deployed (serving: {known})", code="model_not_found"
            )
        if found.phase in ("refused", "failed"):
            stopped = f"{found.deployment_id} {found.phase}: {found.reason}"
            message = f"model {name!r} is not served: {stopped}"
            raise ApiError(404, message, code="model_not_found")
        return found

    @property
    def listed(self) -> list[str]:
        """The models that serve now, by name, each once (a deployment id is an admin detail;
        a deployment pending, loading, refused or failed serves nothing)."""
        return serving_models(self.book)

    def context_of(self, deployment_id: str) -> int:
        deployment = self.book.get(deployment_id)
        return deployment.context_length if deployment else DEFAULT_CONTEXT_TOKENS

    def model_of(self, deployment_id: str) -> str:
        deployment = self.book.get(deployment_id)
        return deployment.model if deployment else deployment_id

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.follower.close()
