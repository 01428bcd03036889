"""``tessera up``'s supervision at work: each service process and server (Redis, every
nats-server) that exits is started again, as ``libs/cluster/supervision.py`` decides (backoff;
failed when it keeps crashing), said on the console, kept in the run file for ``tessera
status`` and told to the cluster (``tell``: the feed, the gateway's metrics, the alerts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from libs.cluster.child_output import exit_text
from libs.cluster.launcher import Cluster
from libs.cluster.servers import EmbeddedServer
from libs.cluster.supervision import BURST, WINDOW_S, ServiceState, Supervisor
from libs.contracts import SERVICE_RESTART, ServiceRestarted
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats


def servers_of(cluster: Cluster) -> dict[str, EmbeddedServer]:
    """The servers under the services, by the name supervision gives them: ``redis``, and
    ``nats`` (``nats-0``, ``nats-1``, … for a NATS cluster)."""
    members = cluster.nats.members
    named = (
        {"nats": members[0]}
        if len(members) == 1
        else dict(zip((f"nats-{i}" for i in range(len(members))), members, strict=True))
    )
    return {**named, "redis": cluster.redis}


def restart_server(cluster: Cluster, name: str) -> bool:
    """Start the server ``name`` again after it exited, on its port and its data (its clients
    reconnect by themselves); False, said, when it would not start."""
    try:
        servers_of(cluster)[name].start()
    except RuntimeError as exc:
        cluster.say("cluster", f"{name} would not start again: {exc}", "bold red")
        return False
    return True


def exited_units(cluster: Cluster) -> list[tuple[str, str, Callable[[], bool]]]:
    """What has exited and may be started again: (name, how it ended, how to start it again)
    for each service process and each server (Redis, every nats-server) found dead; a server
    that would not start again counts as exited too (it is tried again, with backoff)."""
    found: list[tuple[str, str, Callable[[], bool]]] = []
    for child in list(cluster.children):
        if not child.alive:
            found.append(
                (child.name, exit_text(child.returncode), partial(cluster.respawn, child.name))
            )
    for name, server in servers_of(cluster).items():
        process = server.process
        if process is None or process.poll() is not None:
            how = "did not start" if process is None else exit_text(process.returncode)
            found.append((name, how, partial(restart_server, cluster, name)))
    return found


def supervise(cluster: Cluster) -> None:
    """Start each service or server that exits again (``libs/cluster/supervision.py``: backoff,
    and marked failed when it keeps crashing); what each is doing is in the run file, for
    ``tessera status``. Returns only by Ctrl-C or SIGTERM (``KeyboardInterrupt``)."""
    names = [c.name for c in cluster.children] + list(servers_of(cluster))
    supervisor = Supervisor({name: ServiceState() for name in names})
    cluster.record_services(supervisor.report())
    while True:
        for name, how, start_again in exited_units(cluster):
            if supervisor.failed(name):
                continue
            delay = supervisor.exited(name, how, time.monotonic())
            cluster.record_services(supervisor.report())
            if delay is None:
                said = f"{name} {how}, {BURST} restarts in {WINDOW_S:.0f} s: marked failed"
                cluster.say("cluster", f"{said}; the rest goes on (`tessera status`)", "bold red")
                tell(cluster, name, supervisor, "failed")
                continue
            cluster.say("cluster", f"{name} {how}; restarting it in {delay:.1f} s", "bold yellow")
            time.sleep(delay)
            started = time.monotonic()
            back = start_again()
            supervisor.restarted(name, time.monotonic())
            cluster.record_services(supervisor.report())
            took = time.monotonic() - started
            if back:
                cluster.say("cluster", f"{name} back after {took:.1f} s", "white")
                tell(cluster, name, supervisor, "running")
        time.sleep(0.2)


#: How long supervision tries to tell the cluster of a restart.
TELL_TIMEOUT_S = 3.0


def tell(cluster: Cluster, name: str, supervisor: Supervisor, state: str) -> None:
    """Publish a restart (or a service given up on) to the cluster: the dashboard's feed and
    the gateway's metrics hear it. A cluster that cannot be told within ``TELL_TIMEOUT_S``
    (nats-server itself down) is said so, and supervision goes on: it must not wait on the
    very server it may have to start again."""
    service = supervisor.services[name]
    event = ServiceRestarted(
        service=name, how=service.last_exit, restarts=service.restarts, state=state, ts=time.time()
    )

    async def send() -> None:
        nc = await connect_nats(
            cluster.urls("admin")["nats"], "tessera-up", ca_file=cluster.options.nats_ca
        )
        try:
            await NatsBus(nc).publish(SERVICE_RESTART, event, service=name)
        finally:
            await close_nats(nc)

    try:
        asyncio.run(asyncio.wait_for(send(), TELL_TIMEOUT_S))
    except Exception as exc:  # the restart stands; only its telling failed
        cluster.say("cluster", f"could not tell the cluster of {name}'s restart: {exc!r}", "yellow")
