"""Where each deployment runs and what is deployed, as the gateway knows it: ``RouteBook``
(each deployment's route: its epoch and devices in shard order, the devices down, the
deployments still loading; it wakes the streams that follow a deployment) and
``DeployedModels`` (each deployment's model, context length and phase, and which deployment
serves a model's name). Both are kept in this one module: a single fold of deployment events
is to replace them.

Routes enter the book from the scheduler's answer to each request's placement
(``GenerationClient.place``), from the status of a deployment that serves (``RouteBook.watch``),
and from the scheduler's snapshot (``DeployedModels.refresh``: at start, and for a model not
known yet).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from libs.contracts import (
    DEPLOYMENT_STATUS,
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    DeploymentStatus,
    DeviceFailed,
    DeviceRecovered,
    PlacementDecision,
    ShardTask,
    TokenChunk,
)
from libs.runtime.bus import Bus, Delivery, Rejected, Unsubscribe
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
    def serving(cls, status: DeploymentStatus) -> Route:
        """The route of a deployment its status says serves."""
        ordered = sorted(status.shards, key=lambda s: s.shard_index)
        return cls(status.deployment_id, status.epoch, tuple(s.device_id for s in ordered))

    @classmethod
    def of_tasks(cls, tasks: Sequence[ShardTask]) -> Route:
        """The route of a pipeline placed by hand (``libs.harness.workers``)."""
        return cls(tasks[0].deployment_id, tasks[0].epoch, tuple(t.device_id for t in tasks))


class Moved:
    """Put in a stream's queue when its deployment's route changes."""


class Resend:
    """Put in a stream's queue when messages may have been lost (NATS reconnected)."""


#: What a stream waits on: its chunks, and news of its deployment.
Inbox = asyncio.Queue[TokenChunk | Moved | Resend]


class RouteBook:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        #: Devices the scorer reported failed and not recovered since.
        self.down: set[str] = set()
        #: Deployments whose current plan is still loading (re-placed after a failure: the
        #: streams on them wait for it to serve rather than ``move_s``).
        self.loading: set[str] = set()
        self._listeners: dict[str, set[Inbox]] = {}

    def get(self, deployment_id: str) -> Route | None:
        return self.routes.get(deployment_id)

    def set(self, route: Route) -> None:
        """Record ``route`` if it is newer than the one known; wake the streams that use it."""
        known = self.routes.get(route.deployment_id)
        if known is not None and known.epoch >= route.epoch:
            return
        self.routes[route.deployment_id] = route
        for queue in self._listeners.get(route.deployment_id, ()):
            queue.put_nowait(Moved())

    def down_in(self, route: Route) -> list[str]:
        return [d for d in route.devices if d in self.down]

    def failed(self, device_id: str) -> None:
        """A device failed: streams on it wait a little for the re-placement, or give up."""
        self.down.add(device_id)
        self._wake(device_id)

    def recovered(self, device_id: str) -> None:
        self.down.discard(device_id)
        self._wake(device_id)

    def _wake(self, device_id: str) -> None:
        for route in self.routes.values():
            if device_id in route.devices:
                for queue in self._listeners.get(route.deployment_id, ()):
                    queue.put_nowait(Moved())

    def forget(self, deployment_id: str) -> None:
        self.routes.pop(deployment_id, None)

    def resend_all(self) -> None:
        """Every stream asks again for what it has not received (after a reconnect)."""
        for queues in self._listeners.values():
            for queue in queues:
                queue.put_nowait(Resend())

    def listen(self, deployment_id: str, queue: Inbox) -> None:
        self._listeners.setdefault(deployment_id, set()).add(queue)

    def unlisten(self, deployment_id: str, queue: Inbox) -> None:
        self._listeners.get(deployment_id, set()).discard(queue)

    async def watch(
        self,
        bus: Bus,
        rejected: Rejected | None = None,
        on_status: Callable[[DeploymentStatus], None] | None = None,
    ) -> list[Unsubscribe]:
        """Follow deployments' status (a serving one's route: where it moved) and device
        failures; ``on_status`` sees every status too. Returns the subscriptions.

        Routes come from three places: the scheduler's answer to each request's placement
        (``GenerationClient.place``), the status of a deployment that serves (here), and the
        scheduler's snapshot (``DeployedModels.refresh``); the scheduler's broadcast decisions
        are not read."""

        async def on_deployment(status: DeploymentStatus, msg: Delivery) -> None:
            deployment = status.deployment_id
            if status.phase in ("pending", "loading"):
                self.loading.add(deployment)
            else:
                self.loading.discard(deployment)
            if status.phase == "serving" and status.shards:
                self.set(Route.serving(status))
            elif status.phase == "removed":
                self.forget(deployment)
            else:  # its streams look again at how long to wait
                for queue in self._listeners.get(deployment, ()):
                    queue.put_nowait(Moved())
            if on_status is not None:
                on_status(status)

        async def on_failed(event: DeviceFailed, msg: Delivery) -> None:
            self.failed(event.device_id)

        async def on_recovered(event: DeviceRecovered, msg: Delivery) -> None:
            self.recovered(event.device_id)

        return [
            await bus.subscribe(DEPLOYMENT_STATUS, on_deployment, rejected=rejected),
            await bus.subscribe(DEVICE_FAILED, on_failed, rejected=rejected),
            await bus.subscribe(DEVICE_RECOVERED, on_recovered, rejected=rejected),
        ]


@dataclass
class DeployedModels:
    """What is deployed (from the scheduler) and where it runs now (``RouteBook``)."""

    routes: RouteBook
    scheduler_urls: list[str]
    models: dict[str, str] = field(default_factory=dict)  #: deployment id → model
    #: Deployments that are replicas of another (routed to by the scheduler, not listed).
    replicas: set[str] = field(default_factory=set)
    context: dict[str, int] = field(default_factory=dict)
    #: Each deployment's phase (pending, loading, serving, refused, failed) and its reason.
    phases: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    #: Called with each deployed model's name at every refresh (the gateway warms its tokenizer).
    on_model: Callable[[str], None] = lambda model: None

    async def lookup(self, model: str) -> str:
        """``resolve``, asking the scheduler again first when the model is not known yet."""
        try:
            return self.resolve(model)
        except ApiError:
            with contextlib.suppress(httpx.HTTPError):
                await self.refresh()
            return self.resolve(model)

    async def refresh(self) -> None:
        response = await ask_scheduler(self.scheduler_urls, "GET", "placements", timeout_s=5.0)
        response.raise_for_status()
        seen = set()
        for row in response.json():
            deployment = row["deployment_id"]
            seen.add(deployment)
            self.models[deployment] = row["model"]
            self.context[deployment] = int(row["context_length"])
            self.phases[deployment] = (row.get("phase", "serving"), row.get("reason"))
            if row.get("replica_of"):
                self.replicas.add(deployment)
            devices = tuple(
                a["device_id"] for a in sorted(row["assignments"], key=lambda a: a["shard_index"])
            )
            self.routes.set(Route(deployment, int(row["epoch"]), devices))
            if row.get("phase") not in ("refused", "failed"):  # nothing will be asked of it
                self.on_model(row["model"])
        for gone in set(self.models) - seen:
            self.models.pop(gone, None)
            self.phases.pop(gone, None)
            self.replicas.discard(gone)
            self.routes.forget(gone)

    def apply(self, status: DeploymentStatus) -> None:
        """A deployment's status from the scheduler (``DEPLOYMENT_STATUS``): what is deployed
        and in which phase is learned from these, the snapshot ``refresh`` only at start and
        for a model not known yet (routes: ``RouteBook.watch``)."""
        deployment = status.deployment_id
        if status.phase == "removed":
            self.models.pop(deployment, None)
            self.phases.pop(deployment, None)
            self.context.pop(deployment, None)
            self.replicas.discard(deployment)
            return
        self.models[deployment] = status.model
        self.context[deployment] = status.context_length
        self.phases[deployment] = (status.phase, status.reason)
        if status.replica_of:
            self.replicas.add(deployment)
        if status.phase == "serving":
            self.on_model(status.model)

    def phase(self, deployment: str) -> str:
        return self.phases.get(deployment, ("serving", None))[0]

    @property
    def listed(self) -> list[str]:
        """The models that serve now, by name, each once (a deployment id is an admin detail;
        a deployment pending, loading, refused or failed serves nothing)."""
        return sorted({m for d, m in self.models.items() if self.phase(d) == "serving"})

    def resolve(self, model: str) -> str:
        """The deployment serving ``model`` (by deployment id, then by model name; one that
        serves before one still loading). A refused or failed one is named with its reason."""
        final = ("refused", "failed")
        if model in self.models and self.routes.get(model) and self.phase(model) not in final:
            return model
        named = [d for d, name in sorted(self.models.items()) if name == model]
        usable = [d for d in named if self.routes.get(d) is not None]
        for deployment in sorted(usable, key=lambda d: self.phase(d) != "serving"):
            if self.phase(deployment) not in final:
                return deployment
        for deployment in [model, *named]:
            phase, reason = self.phases.get(deployment, ("", None))
            if phase in final:
                message = f"model {model!r} is not served: {deployment} {phase}: {reason}"
                raise ApiError(404, message, code="model_not_found")
        known = ", ".join(self.listed) or "none"
        raise ApiError(
            404, f"model {model!r} is not deployed (serving: {known})", code="model_not_found"
        )
