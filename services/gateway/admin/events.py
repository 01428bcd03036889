"""Live events for the dashboard: what the services already publish on NATS, pushed to each
browser as server-sent events (``GET /v1/cluster/events``).

One subscription per channel for the whole gateway; each client has a bounded queue (the
oldest event is dropped for a client that does not keep up, and counted), and at most
``max_clients`` clients at once. Kinds of event (``type``): ``device`` (a device's row, after
it is scored or fails or recovers), ``failed``, ``recovered``, ``placement`` (a deployment
placed or moved: ``migration`` when its epoch passed 1), ``deployment`` (a deployment's phase
and progress, each time the deployment book changes it), ``weights`` (a device's bytes of a
model received so far, of those it needs, as its worker publishes them; a client that
connects while weights move gets the last of each first), ``mode``, ``service`` (``tessera
up`` started one of its services again, or gave up on one), and ``stats`` every
``stats_every_s`` (cluster tokens/s and tokens/J from the devices' samples, the gateway's
median time to first token over the last minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.asyncio import Redis

from libs.contracts import (
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    MODE_CHANGE,
    PLACEMENT_DECISION,
    SCORE,
    SERVICE_RESTART,
    WEIGHTS_PROGRESS,
    DeviceFailed,
    DeviceRecovered,
    DeviceState,
    ModeChange,
    PlacementDecision,
    ScoreUpdate,
    ServiceRestarted,
    WeightsProgress,
)
from libs.contracts.keys import Keys
from libs.core.energy import cluster_rates
from libs.deployments import DeploymentBook, phases
from libs.runtime.bus import Bus, Delivery, Rejected, Unsubscribe
from libs.runtime.redis_client import ranked_devices, read_devices
from services.gateway.core.errors import ApiError
from services.gateway.core.metrics import Ttfts

log = logging.getLogger(__name__)


#: Seconds after its last progress a fetch's bar is no longer shown to a dashboard that opens.
MOVING_S = 60.0


class EventHub:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ttfts: Ttfts,
        *,
        on_restart: Callable[[str, bool], None] = lambda service, failed: None,
        max_clients: int = 32,
        queue_size: int = 512,
        stats_every_s: float = 2.0,
    ) -> None:
        self.redis, self.keys, self.ttfts = redis, keys, ttfts
        #: Counts a service restarted (or given up on: True) in the gateway's metrics.
        self.on_restart = on_restart
        self.max_clients, self.queue_size, self.stats_every_s = (
            max_clients,
            queue_size,
            stats_every_s,
        )
        self.clients: set[asyncio.Queue[dict[str, Any]]] = set()
        #: Events a slow client never got (its oldest were dropped).
        self.dropped = 0
        #: The last ``weights`` event of each (device, deployment, shard) still moving: a
        #: dashboard opened mid-fetch gets them first (forgotten at the end, or when none came
        #: for ``MOVING_S``: a fetch that stopped).
        self.moving: dict[tuple[str, str, int], dict[str, Any]] = {}

    # -- fan-out -------------------------------------------------------------------------------
    def push(self, event: dict[str, Any]) -> None:
        for queue in self.clients:
            if queue.full():
                queue.get_nowait()
                self.dropped += 1
            queue.put_nowait(event)

    async def stream(self, keepalive_s: float = 15.0) -> AsyncIterator[str]:
        """One client's events as SSE lines; 429 past ``max_clients``."""
        if len(self.clients) >= self.max_clients:
            raise ApiError(
                429,
                f"{self.max_clients} dashboards are already following this gateway",
                "rate_limit_error",
                "too_many_listeners",
            )
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self.queue_size)
        for event in self._moving():
            queue.put_nowait(event)
        self.clients.add(queue)

        async def events() -> AsyncIterator[str]:
            try:
                yield ": connected\n\n"
                while True:
                    try:
                        event = await asyncio.wait_for(queue.get(), keepalive_s)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"data: {json.dumps(event)}\n\n"
            finally:
                self.clients.discard(queue)

        return events()

    # -- sources -------------------------------------------------------------------------------
    async def watch(self, bus: Bus, rejected: Rejected | None = None) -> list[Unsubscribe]:
        """Subscribe to what the dashboard shows. ``rejected`` counts the malformed messages of
        the channels only this hub reads (the deployment book counts the others once)."""

        async def on_score(update: ScoreUpdate, msg: Delivery) -> None:
            await self._device(update.device_id)

        async def on_failed(event: DeviceFailed, msg: Delivery) -> None:
            self.push({"type": "failed", **event.model_dump(mode="json")})
            await self._device(event.device_id)

        async def on_recovered(event: DeviceRecovered, msg: Delivery) -> None:
            self.push({"type": "recovered", **event.model_dump(mode="json")})
            await self._device(event.device_id)

        async def on_decision(decision: PlacementDecision, msg: Delivery) -> None:
            if decision.kind == "deployment" and decision.placed and self.clients:
                body = decision.model_dump(mode="json")
                self.push({"type": "placement", "migration": decision.epoch > 1, **body})

        async def on_weights(progress: WeightsProgress, msg: Delivery) -> None:
            event = {"type": "weights", **progress.model_dump(mode="json")}
            key = (progress.device_id, progress.deployment_id, progress.shard_index)
            if progress.bytes_done < progress.bytes_total:
                self.moving[key] = event | {"seen": time.monotonic()}
            else:
                self.moving.pop(key, None)
            if self.clients:
                self.push(event)

        async def on_mode(change: ModeChange, msg: Delivery) -> None:
            self.push({"type": "mode", **change.model_dump(mode="json")})

        async def on_restart(event: ServiceRestarted, msg: Delivery) -> None:
            self.on_restart(event.service, event.state == "failed")
            self.push({"type": "service", **event.model_dump(mode="json")})

        return [
            await bus.subscribe(SCORE, on_score, rejected=rejected),
            await bus.subscribe(MODE_CHANGE, on_mode, rejected=rejected),
            await bus.subscribe(DEVICE_FAILED, on_failed),
            await bus.subscribe(DEVICE_RECOVERED, on_recovered),
            # Counted here: the deployment book follows events, not this broadcast.
            await bus.subscribe(PLACEMENT_DECISION, on_decision, rejected=rejected),
            await bus.subscribe(WEIGHTS_PROGRESS, on_weights, rejected=rejected),
            await bus.subscribe(SERVICE_RESTART, on_restart, rejected=rejected),
        ]

    def on_deployments(self, before: DeploymentBook, after: DeploymentBook) -> None:
        """The deployment book changed (the gateway follows it, core/deployed.py): each
        deployment that changed is pushed as its status (``removed`` once it is gone)."""
        if not self.clients:
            return
        now = time.time()
        for deployment_id in sorted(set(before.by_id) | set(after.by_id)):
            old, new = before.get(deployment_id), after.get(deployment_id)
            if old == new:
                continue
            if new is None:
                assert old is not None
                status = phases.status_of(old, now).model_copy(update={"phase": "removed"})
            else:
                status = phases.status_of(new, now)
            self.push({"type": "deployment", **status.model_dump(mode="json")})

    def _moving(self) -> list[dict[str, Any]]:
        """The weights still on their way, as their last events (the stale ones forgotten)."""
        since = time.monotonic() - MOVING_S
        self.moving = {k: e for k, e in self.moving.items() if e["seen"] >= since}
        return [{k: v for k, v in e.items() if k != "seen"} for e in self.moving.values()]

    async def _device(self, device_id: str) -> None:
        """Push the device's row as Redis holds it: the scorer announces a change only once
        it is written, so the row read on an event already shows it."""
        if not self.clients:
            return
        rows = await read_devices(self.redis, self.keys, [device_id])
        for row in rows:
            self.push({"type": "device", "device": row.model_dump(mode="json")})

    async def stats(self) -> None:
        """One ``stats`` event (a periodic step of the gateway)."""
        if not self.clients:
            return
        rows = await ranked_devices(self.redis, self.keys, 10_000)
        live = (r.sample for r in rows if r.sample and r.state != DeviceState.FAILED)
        tokens, per_joule = cluster_rates(live)
        self.push(
            {
                "type": "stats",
                "ts": time.time(),
                "tokens_per_s": round(tokens, 3),
                "tokens_per_j": round(per_joule, 5),
                "ttft_p50_s": self.ttfts.median(),
                "dropped": self.dropped,
            }
        )

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.clients.clear()
