"""Two faults of a placement that never serves, for the chaos harness.

``worker_refuses``: the model's worker is killed; the device the scheduler then prefers runs a
worker that refuses the shard, for a real reason: it holds weights in float32
(``TESSERA_WORKER_PRECISION``) on a memory cap (``TESSERA_WORKER_MEMORY_GB``) that the
planner, counting the model's own int8 weights, thinks enough (0.48 of 0.51 GB free) and the
worker does not (0.54 GB). The scheduler must place the model again without it.

``worker_killed_loading``: the model's worker is killed; the device the scheduler then prefers
runs a worker that is SIGKILLed the moment it reports the shard loading. The scheduler must see
it fail and place the model again.

Both need the scheduler's first choice to be the special worker: beside it runs a spare worker
of the cluster's engine at half speed (the planner prefers the faster device), and the
cluster's other worker is stopped before the load begins. Counted: requests sent to the
special worker (``misrouted``: only a serving copy gets requests, so 0) and ``replace_s``,
from the refusal or the kill to the model serving again (the scheduler's
deployment events, folded as the gateway folds them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from libs.cluster.launcher import Cluster
from libs.contracts import (
    GENERATION,
    SHARD_STATUS,
    DeploymentsSnapshot,
    GenerationRequest,
    ShardStatus,
)
from libs.deployments import DeploymentBook
from libs.runtime.bus import Delivery, NatsBus
from libs.runtime.following import BookFollower
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.procs import ServiceProcess, free_port

FAULTS = ("worker_refuses", "worker_killed_loading")
REFUSER, LOADER, SPARE = "worker-refuses", "worker-loads", "worker-spare"
#: Devices these faults add to a cluster (each needs its NATS user before the cluster starts).
DEVICES = (REFUSER, LOADER, SPARE)
#: The refuser's memory (GB): 80 % of it (0.51 GB) holds the planner's SmolLM2 in int8 with a
#: 2,048-token cache (0.48 GB), not the worker's float32 weights (0.54 GB).
REFUSER_MEMORY_GB = 0.64


@dataclass
class Seen:
    """What the harness saw on NATS during one fault (monotonic times)."""

    special: str
    model: str
    misrouted: int = 0
    refused_at: float | None = None
    loading_at: float | None = None
    killed_at: float | None = None
    serving: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def replace_s(self) -> float | None:
        """From the refusal or the kill to the first serving status after it."""
        since = self.refused_at if self.refused_at is not None else self.killed_at
        if since is None:
            return None
        later = [at for at, _ in self.serving if at >= since]
        return later[0] - since if later else None


class Watcher:
    """A NATS client on its own thread: counts requests sent to the special device, notes its
    shard statuses (``on_loading`` runs once, on its first ``loading``) and the model's
    serving statuses."""

    def __init__(
        self,
        url: str,
        seen: Seen,
        on_loading: Callable[[], None] | None,
        scheduler_urls: list[str],
    ) -> None:
        """``scheduler_urls``: where the deployment book is fetched at start and when an event
        is missing (the first event it gets follows many: without the book, the serving it
        announces would be seen only at the next snapshot, after the fault)."""
        self.url, self.seen, self.on_loading = url, seen, on_loading
        self.scheduler_urls = scheduler_urls
        self.ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the fault's watcher could not connect to NATS")
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    async def _run(self) -> None:
        seen = self.seen
        nc = await connect_nats(self.url, "chaos-watch")
        bus = NatsBus(nc)

        async def on_request(request: GenerationRequest, msg: Delivery) -> None:
            seen.misrouted += 1

        async def on_shard(status: ShardStatus, msg: Delivery) -> None:
            if status.deployment_id != seen.model:
                return
            if status.state == "refused" and seen.refused_at is None:
                seen.refused_at = time.monotonic()
            if status.state == "loading" and seen.loading_at is None:
                seen.loading_at = time.monotonic()
                if self.on_loading is not None:
                    self.on_loading()
                    seen.killed_at = time.monotonic()

        def on_change(before: DeploymentBook, after: DeploymentBook) -> None:
            old, new = before.get(seen.model), after.get(seen.model)
            if new is not None and new.phase == "serving" and new != old:
                seen.serving.append((time.monotonic(), new.route))

        follower = BookFollower(self._fetch)
        await follower.catch_up()
        follower.on_change(on_change)

        subs = [
            await bus.subscribe(
                GENERATION, on_request, subject=GENERATION.pattern(device_id=seen.special)
            ),
            await bus.subscribe(
                SHARD_STATUS, on_shard, subject=SHARD_STATUS.subject(device_id=seen.special)
            ),
            *await follower.watch(bus),
        ]
        await nc.flush()
        self.ready.set()
        try:
            while not self.stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            for sub in subs:
                await sub.unsubscribe()
            await close_nats(nc)

    async def _fetch(self) -> DeploymentsSnapshot:
        async with httpx.AsyncClient(timeout=5.0) as http:
            for url in self.scheduler_urls:  # only the leader listens: a standby refuses
                with contextlib.suppress(httpx.HTTPError):
                    answer = await http.get(f"{url}/deployments")
                    answer.raise_for_status()
                    return DeploymentsSnapshot.model_validate(answer.json())
        raise RuntimeError("no scheduler answered GET /deployments")


class PlacementFaults:
    """Set-up, injection and healing of ``FAULTS`` on a chaos cluster."""

    def __init__(self, cluster: Cluster, url: str, model: str, interval_s: float) -> None:
        self.cluster, self.url, self.model, self.interval_s = cluster, url, model, interval_s
        self.extra: dict[str, ServiceProcess] = {}
        self.stopped: list[str] = []  #: cluster workers taken away for the fault
        self.holder: str | None = None
        self.watcher: Watcher | None = None
        self.seen: Seen | None = None

    # -- before the load ------------------------------------------------------------------
    def prepare(self, fault: str, holder: str) -> None:
        """Start the special worker and the spare, wait until the scheduler places on them,
        and stop the cluster's other workers (they would tie with the special one)."""
        special = REFUSER if fault == "worker_refuses" else LOADER
        self.holder = holder
        for device in (special, SPARE):
            self.extra[device] = self._spawn(device)
        self._wait_devices(lambda live: {special, SPARE} <= live, "the fault's workers joined")
        others = [n for n, _ in self.cluster.worker_names() if n != holder]
        for name in others:
            self.cluster.child(name).kill()
            self.stopped.append(name)
        self._wait_devices(lambda live: not live & set(others), "the other workers failed")
        on_loading = self.extra[special].kill if special == LOADER else None
        self.seen = Seen(special, self.model)
        admin = self.cluster.urls("admin")["nats"]
        self.watcher = Watcher(admin, self.seen, on_loading, self.cluster.scheduler_urls).start()

    def _spawn(self, device: str) -> ServiceProcess:
        settings = {
            "DEVICE_ID": device,
            # The spare serves the model on: the cluster's engine, so the text stays the same.
            "ENGINE": self.cluster.options.cpu_engine if device == SPARE else "torch",
            "SEED": "7",
            "METRICS_PORT": str(free_port()),
            "INTERVAL_S": str(self.interval_s),
        }
        if device == REFUSER:
            settings.update(PRECISION="float32", MEMORY_GB=str(REFUSER_MEMORY_GB))
        elif device == SPARE:
            settings.update(SPEED_FACTOR="0.5", PRELOAD="true")
        env = {
            **self.cluster.child_env(),
            "TESSERA_NATS_URL": self.cluster.urls(device)["nats"],
            "OMP_NUM_THREADS": "1",
            **{f"TESSERA_WORKER_{k}": v for k, v in settings.items()},
        }
        colour = "magenta"
        process = ServiceProcess(
            device,
            env,
            ["-m", "services.worker"],
            on_line=lambda line: self.cluster.say(device, str(line.get("msg", line)), colour),
        )
        return process.start(ready_timeout_s=180)

    def _wait_devices(self, done: Callable[[set[str]], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if done(self._live()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"not seen within 60 s: {what}")

    def _live(self) -> set[str]:
        for url in self.cluster.scheduler_urls:
            try:
                answer = httpx.get(f"{url}/healthz", timeout=2)
                return set(answer.json().get("devices", ()))
            except (httpx.HTTPError, ValueError):
                continue
        return set()

    # -- the fault --------------------------------------------------------------------------
    def inject(self) -> Callable[[], bool]:
        """Kill the model's worker; recovered once the model serves on the spare."""
        assert self.holder is not None
        self.cluster.child(self.holder).kill()
        self.stopped.append(self.holder)
        return lambda: self.status().get("phase") == "serving" and self.devices() == [SPARE]

    def status(self) -> dict[str, Any]:
        try:
            answer = httpx.get(f"{self.url}/v1/cluster/placements/{self.model}", timeout=3)
            body = answer.json()
        except (httpx.HTTPError, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    def devices(self) -> list[str]:
        shards = self.status().get("shards") or []
        return [str(s["device_id"]) for s in shards]

    # -- afterwards -------------------------------------------------------------------------
    def heal(self) -> Seen | None:
        """The cluster's workers back, the model back on them, the fault's workers gone."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        for name in self.stopped:
            self.cluster.respawn(name)
        self.stopped = []
        spare = self.extra.pop(SPARE, None)
        if spare is not None:
            spare.stop()  # the model moves back to a worker of the cluster
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                devices = self.devices()
                if self.status().get("phase") == "serving" and devices and SPARE not in devices:
                    break
                time.sleep(0.2)
        for process in self.extra.values():
            process.stop()
        self.extra = {}
        seen, self.seen = self.seen, None
        return seen

    def close(self) -> None:
        """Stop what a fault left running (the harness stops mid-fault)."""
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        for process in self.extra.values():
            process.stop()
        self.extra = {}
