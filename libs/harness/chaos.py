"""The chaos harness: a local cluster under steady chat load, one fault at a time, outcomes counted.

``Chaos`` runs ``tessera up``'s ``Cluster`` in this process (two workers, a small emulated
fleet, SmolLM2 deployed), drives ``concurrency`` streaming clients through the gateway with
short greedy requests, injects a fault once a third of the requests are done, and counts every
request as ``completed`` (the exact text of an undisturbed run: nothing missing, nothing
repeated), ``failed`` (an error the client could read), ``corrupt`` (completed with other text)
or ``lost`` (no answer at all). ``recovery_s`` runs from the fault until a new request streams
again (its first token) and the fault's own check passes (the scheduler knows the deployment
again; every device is back in Redis with scores). Faults: SIGKILL the worker holding the
model, SIGKILL the telemetry agent (restarted), SIGKILL the leading one of two scheduler
replicas (the other takes over from the checkpoint and live state; the killed one restarts as
a follower), SIGKILL every scheduler replica and restart them (from the checkpoint alone),
restart nats-server, restart redis-server, and a lying device: the worker serving the model
announces 10× its speed (recovered when the scorer scores it by its measured speed again).
With ``nats_servers=3``, one more: SIGKILL one of the three servers of the NATS cluster (its
clients move to the others; it restarts afterwards). Two faults of a placement that never
serves (``placement_faults.py``): the model's worker is lost and the device chosen next
refuses the shard, or is killed while it loads; their rows add ``misrouted`` (requests sent to
that worker: 0) and ``replace_s`` (from the refusal or kill until the model serves again).
Used by ``bench/chaos.py`` and, at small scale, the tests. The load and its counting are
``chat_load.py``'s; an outcome and the results table, ``chaos_outcomes.py``'s.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis
from rich.console import Console

from libs.cluster.engine_choice import choose_cpu_engine
from libs.cluster.launcher import Cluster
from libs.cluster.servers import NatsServer
from libs.cluster.up import deploy_model
from libs.cluster.up_options import UpOptions
from libs.contracts import ANNOUNCE, ContractError, DeviceAnnounce
from libs.contracts.keys import DeviceRow, Keys
from libs.harness import placement_faults
from libs.harness.chaos_outcomes import Outcome
from libs.harness.chat_load import ChatLoad, load_env
from libs.harness.placement import model_devices
from libs.harness.placement_faults import PlacementFaults
from libs.runtime.bus import publish
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.procs import free_port

MODEL = "smollm2-135m-instruct"
FAULTS = (
    "worker_kill",
    "telemetry_kill",
    "scheduler_leader_kill",
    "scheduler_restart",
    "nats_restart",
    "redis_restart",
    "lying_device",
    *placement_faults.FAULTS,
)
#: Faults of a cluster whose NATS is a cluster of three servers (``nats_servers=3``).
NATS_CLUSTER_FAULTS = ("nats_member_kill",)
#: How much the lying device overstates its speed.
LIE = 10.0


class Chaos:
    def __init__(
        self,
        *,
        devices: int = 2,
        concurrency: int = 4,
        max_tokens: int = 8,
        interval_s: float = 1.0,
        log_path: Path | None = None,
        nats_servers: int = 1,
        engine: str | None = None,
    ) -> None:
        self.concurrency, self.max_tokens, self.interval_s = concurrency, max_tokens, interval_s
        self.devices = devices
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (log_path or Path(tempfile.mkdtemp()) / "chaos.log").open("w")
        self.options = UpOptions(
            gateway_port=port,
            devices=devices,
            workers=2,
            cpu_engine=choose_cpu_engine(engine)[0],  # as `make up` chooses, unless asked
            scheduler_port=free_port(),
            scheduler_replicas=2,
            nats_servers=nats_servers,
            extra_env=load_env(interval_s),
        )
        self.cluster = Cluster(self.options, Console(file=log, width=200))
        access = self.cluster.access
        if access is not None:  # the placement faults' workers are devices of this cluster
            for device in placement_faults.DEVICES:
                access.admit(device)
            nats = self.cluster.nats
            nats.config = access.write_nats_config(nats.data_dir / "nats.conf")
        self.placements = PlacementFaults(self.cluster, self.url, MODEL, interval_s)
        self.chat = ChatLoad(self.url, MODEL, max_tokens, concurrency)
        self.killed: str | None = None  #: a worker a fault killed, respawned after it
        self.fault_at = 0.0  #: when the last fault struck (monotonic s): recovery runs from it
        self.lied: DeviceAnnounce | None = None  #: a device's true announce, sent again after
        self.downed: NatsServer | None = None  #: a NATS cluster member a fault killed

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.cluster.start()
        if not self.cluster.wait_ready():
            raise RuntimeError("the cluster did not start")
        placed = deploy_model(self.options, MODEL)
        if not placed.startswith("deployed"):
            raise RuntimeError(placed)
        self.chat.learn_answers()

    def stop(self) -> None:
        self.placements.close()
        self.cluster.stop()

    # -- one fault -----------------------------------------------------------------------------
    def run(self, fault: str, requests: int) -> Outcome:
        """Load in a thread; the fault, the restarts and the recovery probe from this one (a
        child started from a passing thread would get SIGTERM when that thread ends: the
        launcher's children die with their parent, and Linux means the parent thread)."""
        outcome = Outcome(fault)
        if fault in placement_faults.FAULTS:  # its workers join before the load begins
            self.placements.prepare(fault, self._placement()[0])
        began = time.monotonic()
        third = threading.Event()
        load = threading.Thread(
            target=lambda: asyncio.run(self.chat.run(requests, outcome.counts, third)),
            daemon=True,
        )
        load.start()
        third.wait()
        self.fault_at = time.monotonic()  # _inject moves it to the fault itself, after look-ups
        check = self._inject(fault)
        outcome.recovery_s = self._recover(self.fault_at, check)
        load.join()
        outcome.elapsed_s = time.monotonic() - began
        self._heal()
        if fault in placement_faults.FAULTS and (seen := self.placements.heal()) is not None:
            outcome.misrouted, outcome.replace_s = seen.misrouted, seen.replace_s()
        return outcome

    def _recover(self, started: float, check: Callable[[], bool]) -> float | None:
        """Seconds from the fault until a fresh request streams and ``check`` passes."""
        served = False
        while time.monotonic() < started + 120:
            served = served or asyncio.run(self.chat.streams_again())
            if served and check():
                return time.monotonic() - started
            time.sleep(0.1)
        return None

    # -- faults --------------------------------------------------------------------------------
    def _inject(self, fault: str) -> Callable[[], bool]:
        cluster = self.cluster
        if fault == "worker_kill":
            host = self._placement()[0]
            self.fault_at = time.monotonic()
            cluster.child(host).kill()
            self.killed = host
            return lambda: host not in self._placement()
        if fault == "telemetry_kill":
            cluster.child("telemetry").kill()
            if not cluster.respawn("telemetry"):
                raise RuntimeError("telemetry did not come back")
            return self._devices_healthy
        if fault == "scheduler_leader_kill":  # the standby takes over; it restarts afterwards
            leader = self._leader()
            self.fault_at = time.monotonic()
            cluster.child(leader).kill()
            self.killed = leader
            return lambda: bool(self._placement()) and self._leader() != leader
        if fault == "scheduler_restart":  # no standby: both come back from the checkpoint
            for name in self.cluster.scheduler_ports:
                cluster.child(name).kill()
            for name in self.cluster.scheduler_ports:
                if not cluster.respawn(name):
                    raise RuntimeError(f"{name} did not come back")
            return lambda: bool(self._placement())
        if fault == "lying_device":
            host = self._placement()[0]
            self.lied = self._announced(host)
            caps = self.lied.capabilities
            lie = caps.model_copy(
                update={
                    "fp32_tflops": caps.fp32_tflops * LIE,
                    "int8_tops": caps.int8_tops * LIE,
                    "memory_bandwidth_gbps": caps.memory_bandwidth_gbps * LIE,
                }
            )
            self._announce(self.lied.model_copy(update={"capabilities": lie}))
            return lambda: self._seen_through(host)
        if fault in placement_faults.FAULTS:
            return self.placements.inject()
        if fault == "nats_restart":
            cluster.nats.restart()
            return lambda: True
        if fault == "nats_member_kill":
            members = cluster.nats.members
            if len(members) < 3:
                raise ValueError("nats_member_kill needs a NATS cluster: Chaos(nats_servers=3)")
            self.downed = members[0]
            self.downed.kill()
            return self._devices_healthy
        if fault == "redis_restart":
            cluster.redis.restart()
            return self._devices_healthy
        known = ", ".join((*FAULTS, *NATS_CLUSTER_FAULTS))
        raise ValueError(f"unknown fault {fault!r}; known: {known}")

    def _heal(self) -> None:
        """Bring back what a fault took away (a killed worker's device rejoins; a killed
        scheduler replica comes back as the standby)."""
        if self.killed is not None:
            killed, self.killed = self.killed, None
            self.cluster.respawn(killed)
        if self.lied is not None:
            truth, self.lied = self.lied, None
            self._announce(truth)
        if self.downed is not None:
            downed, self.downed = self.downed, None
            downed.start()

    def _leader(self) -> str:
        """The scheduler replica that leads: the one serving HTTP."""
        for name, port in self.cluster.scheduler_ports.items():
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).raise_for_status()
                return name
            except httpx.HTTPError:
                continue
        raise RuntimeError("no scheduler replica leads")

    def _placement(self) -> list[str]:
        """The model's devices, from whichever replica leads (through the gateway)."""
        return model_devices(self.url, MODEL)

    def _redis(self) -> redis.Redis:
        url = self.cluster.urls("admin")["redis"]
        return redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)

    def _row(self, device_id: str) -> DeviceRow:
        with self._redis() as client:
            return DeviceRow.decode(device_id, client.hgetall(Keys().device(device_id)))

    def _announced(self, device_id: str) -> DeviceAnnounce:
        with self._redis() as client:
            return DeviceAnnounce.model_validate_json(client.get(Keys().caps(device_id)))

    def _announce(self, announce: DeviceAnnounce) -> None:
        """Publish ``announce`` as if the device sent it."""

        async def send() -> None:
            nc = await connect_nats(self.cluster.urls("admin")["nats"], "chaos")
            try:
                await publish(nc, ANNOUNCE, announce, device_id=announce.device_id)
                await nc.flush()
            finally:
                await close_nats(nc)

        asyncio.run(send())

    def _seen_through(self, device_id: str) -> bool:
        """The lie is seen through: what the scorer now believes of the device's speed is
        within 2× of the truth (both devices measure one-row steps, so they differ by little
        more than the noise of a shared machine)."""
        try:
            scale = self._row(device_id).speed_scale
        except (redis.RedisError, ContractError):
            return False
        return scale * LIE <= 2.0

    def _devices_healthy(self) -> bool:
        """Every device scored again in Redis, none marked failed."""
        keys = Keys()
        try:
            with self._redis() as client:
                ranked = client.zrange(keys.rank("total"), 0, -1)
                failed = client.smembers(keys.failed)
        except redis.RedisError:
            return False
        alive = {str(d) for d in ranked} - {str(d) for d in failed}
        return len(alive) >= self.devices + len(self.cluster.worker_names())
