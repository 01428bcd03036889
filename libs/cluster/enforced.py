"""The workers of ``tessera up --fleet FILE`` that the kernel holds to their device's size
(the fleet file's ``workers``, ``libs/devices/fleetfile.py``): each runs inside a cgroup of its
own (``libs/cluster/limits.py``) with its CPU quota and memory limit, reports its class, the
memory it may use, and the speed it measures inside its quota (``TESSERA_WORKER_CPUS``: the
worker calibrates itself there instead of reading the host's cached calibration).

A worker with a ``link`` runs in a network namespace of its own, joined to the head by a veth
``tc`` holds to the link's bandwidth, and reaches NATS through a relay that adds the link's
round trip (``libs/cluster/links.py``); it measures that round trip itself.

Where the kernel cannot enforce limits (no root, no cgroup controllers) ``start`` says why and
the workers run unlimited, with the memory the file gives them; where it cannot make links,
the linked workers run on the head's network, and ``start`` says so too.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from libs.cluster import links
from libs.cluster.limits import Group, Limits, LimitsUnavailable
from libs.cluster.links import LinkedHost
from libs.devices.fleetfile import WorkerSpec, fleet_from_file


class EnforcedFleet:
    def __init__(self, workers: tuple[WorkerSpec, ...], run_id: str) -> None:
        self.workers = {w.id: w for w in workers}
        self.groups = {
            w.id: Group(f"{run_id}-{w.id}", Limits(cpus=w.cpus, memory_gb=w.memory_gb))
            for w in workers
        }
        self.enforced = False
        subnet = 200 + secrets.randbelow(50)  # 10.200–249.*: one run's links, apart from others
        linked = [(w.id, w.link) for w in workers if w.link is not None]
        self.links = {
            name: LinkedHost(run_id, i, subnet, link.rtt_ms, link.mbit)
            for i, (name, link) in enumerate(linked)
        }
        self.linked: dict[str, LinkedHost] = {}  # those made (start)

    @classmethod
    def read(cls, path: Path | None, run_id: str) -> EnforcedFleet | None:
        """The fleet file's workers, or None when it lists none (or there is no file)."""
        if path is None:
            return None
        spec = fleet_from_file(path)
        return cls(spec.workers, run_id) if spec.workers else None

    def names(self, engine: str) -> list[tuple[str, str]]:
        return [(name, engine) for name in self.workers]

    def env(self, name: str) -> dict[str, str]:
        worker = self.workers[name]
        threads = str(max(1, round(worker.cpus)))  # the cores its quota gives, at least one
        env = {
            "TESSERA_WORKER_DEVICE_CLASS": worker.device_class.value,
            "TESSERA_WORKER_MEMORY_GB": str(worker.memory_gb),
            "TESSERA_WORKER_LLAMA_THREADS": threads,
            "OMP_NUM_THREADS": threads,
        }
        if self.enforced:
            env["TESSERA_WORKER_CPUS"] = str(worker.cpus)
        if (link := self.linked.get(name)) is not None:
            env["TESSERA_WORKER_RPC_HOST"] = link.address  # its RPC server listens there,
            env["TESSERA_WORKER_RPC_PORT"] = str(links.RPC_PORT)
            env["TESSERA_WORKER_RPC_ANNOUNCE"] = link.rpc_address  # the head reaches it here
            env["TESSERA_WORKER_LINK_MBIT"] = str(link.mbit)
            env["TESSERA_WORKER_MEASURE_RTT"] = "true"
        return env

    def nats_url(self, name: str, url: str) -> str:
        """``url`` as worker ``name`` reaches NATS: through its link's relay where it has one."""
        link = self.linked.get(name)
        if link is None:
            return url
        first = urlsplit(url.split(",")[0])
        credentials = first.netloc.rpartition("@")[0]
        netloc = f"{credentials}@{link.nats_address}" if credentials else link.nats_address
        return urlunsplit(first._replace(netloc=netloc))

    def prefix(self, name: str) -> list[str]:
        held = self.groups[name].prefix() if self.enforced and name in self.groups else []
        link = self.linked.get(name)
        return [*held, *(link.prefix() if link else [])]  # its groups, then its network

    def start(self, say: Callable[[str], None], nats_url: str = "") -> None:
        """Make every worker's group, then its link to NATS at ``nats_url``; where the kernel
        cannot, say why and go on without (unlimited, or on the head's network)."""
        self._start_links(say, nats_url)
        try:
            for group in self.groups.values():
                group.create()
        except LimitsUnavailable as exc:
            self.stop()
            say(f"fleet: limits not enforced ({exc}): its workers run unlimited")
            return
        self.enforced = True
        for name, worker in self.workers.items():
            say(
                f"fleet: {name} ({worker.device_class.value}) held to {worker.cpus:g} cores "
                f"and {worker.memory_gb:g} GB"
            )

    def _start_links(self, say: Callable[[str], None], nats_url: str) -> None:
        if not self.links:
            return
        reason = links.unavailable()
        target = urlsplit(nats_url.split(",")[0])
        if reason is None and not target.port:
            reason = f"no NATS address to relay to ({nats_url!r})"
        if reason is not None:
            say(f"fleet: links not made ({reason}): its workers use the head's network")
            return
        for name, link in self.links.items():
            try:
                link.create(f"{target.hostname}:{target.port}")
            except (RuntimeError, OSError) as exc:
                link.remove()
                say(f"fleet: {name}'s link not made ({exc}): it uses the head's network")
                continue
            self.linked[name] = link
            say(
                f"fleet: {name} on a link of {link.mbit:g} Mbit/s each way, {link.rtt_ms:g} ms "
                f"added to its round trip (namespace {link.namespace}, {link.address})"
            )

    def stop(self) -> None:
        """Remove the links and the groups (once their processes have stopped)."""
        for link in self.linked.values():
            link.remove()
        self.linked.clear()
        for group in self.groups.values():
            with contextlib.suppress(RuntimeError):  # a process still inside: left behind
                group.remove()
