"""What ``tessera up`` starts (``UpOptions``), which services exist to start, and the port and
run file it takes when another cluster on this machine holds the preferred ones."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from libs.cluster import runfile
from libs.runtime.procs import free_port, port_free

#: Start order: consumers before producers, the front door last.
SERVICE_ORDER = ("scorer", "telemetry", "scheduler", "worker", "gateway", "batch.worker")


def available_services(names: Iterable[str] = SERVICE_ORDER) -> list[str]:
    """The services that have an entry point (``services.<name>.__main__``)."""
    return [n for n in names if importlib.util.find_spec(f"services.{n}.__main__") is not None]


@dataclass
class UpOptions:
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    devices: int = 6
    #: CPU shard workers, each its own process and device (``worker-0``, ``worker-1``, …).
    workers: int = 2
    #: The CPU workers' engine: ``torch`` or ``llamacpp`` (engine_choice.cpu_engine).
    cpu_engine: str = "torch"
    #: Workers with the vLLM engine (``vllm-0``, …; whole models, ``make vllm`` first).
    vllm_workers: int = 0
    #: Why these engines (libs/cluster/engine_choice.py), said at start.
    engines_note: str = ""
    #: Models deployed once the cluster is ready (when it has workers), named after the model.
    deploy: tuple[str, ...] = ("smollm2-135m-instruct",)
    fleet: Path | None = None
    scheduler_port: int = 8100
    #: Scheduler replicas: one leads (a lease in NATS KV), the others stand by to take over.
    scheduler_replicas: int = 1
    ready_timeout_s: float = 180.0
    extra_env: dict[str, str] = field(default_factory=dict)
    #: NATS users with subject permissions and Redis ACL users, one per service and worker
    #: (``libs/cluster/access.py``); passwords drawn per run, the admin's in the run file only.
    access: bool = True
    run_file: Path | None = None
    #: An address of this host other hosts reach: NATS listens there (not on loopback) and
    #: hosts join with ``tessera join`` (``libs/cluster/joining.py``). None: loopback only.
    listen: str | None = None
    #: nats-servers routed into one NATS cluster (JetStream keeps three copies from 3 on):
    #: the cluster goes on when one of them goes.
    nats_servers: int = 1
    #: TLS on NATS: (certificate chain, key) of its servers, and the CA services trust.
    nats_tls: tuple[Path, Path] | None = None
    nats_ca: Path | None = None
    #: The cluster's home (``libs/cluster/home.py``): what a restart keeps. None: temporary
    #: folders, gone when it stops (the test and benchmark harnesses' clusters).
    home: Path | None = None
    #: Delete what the home holds before starting (``tessera up --fresh``).
    fresh: bool = False
    #: A gateway reachable from the LAN with no API key (``--open``): said at every start.
    open_lan: bool = False
    #: Start a service that exits again (``libs/cluster/supervision.py``); False: one that
    #: exits stops the cluster (a worker's device is lost instead).
    restart: bool = True


class StartRefused(RuntimeError):
    """``tessera up`` must not start as asked: the message says why and what to do."""


LOOPBACK = ("127.", "::1", "localhost")


def lan_exposure(gateway_host: str, has_keys: bool, open_lan: bool) -> str | None:
    """A warning to say at start for a gateway the LAN reaches with no key (``--open``);
    None when it asks for keys or only this machine reaches it. ``StartRefused`` without
    ``--open``: the LAN never gets an open gateway by default."""
    if gateway_host.startswith(LOOPBACK) or has_keys:
        return None
    if not open_lan:
        raise StartRefused(
            f"the gateway would listen on {gateway_host} with no API key: anyone on the LAN "
            "could use the cluster and its admin API. Make a key first (`tessera keys create "
            "NAME`), or pass --open to serve it without keys anyway"
        )
    return (
        f"WARNING: --open: the gateway on {gateway_host} asks no API key; anyone who reaches "
        "it uses the cluster and its admin API"
    )


def choose_port(host: str, preferred: int) -> int:
    """``preferred`` when it is free, else any free port (another cluster may hold it)."""
    return preferred if port_free(host, preferred) else free_port(host)


def choose_run_file(preferred: Path) -> Path:
    """``preferred``, unless a running cluster holds it (its lock, not its pid: see
    ``libs/cluster/runfile.py``): then ``cluster-<pid>.json`` beside it (commands given no
    address keep finding the first cluster). The cluster claims it when it starts."""
    if not runfile.held(preferred):
        return preferred
    return preferred.with_name(f"{preferred.stem}-{os.getpid()}{preferred.suffix}")


def join_commands(url: str, token: str, ca: Path | None) -> tuple[str, str]:
    """What ``tessera up --listen`` prints for other hosts: ``tessera join`` in a checkout set
    up, and ``make join`` in a fresh clone (it builds llama.cpp and the virtualenv first)."""
    joins = f"tessera join {url} --token {token}"
    make = f"make join ADDR={url} TOKEN={token}"
    if ca is not None:
        joins, make = f"{joins} --ca {ca}", f'{make} ARGS="--ca {ca}"'
        copy = f" (copy {ca} to that host first)"
        joins, make = joins + copy, make + copy
    return f"other hosts join with: {joins}", f"or, from a fresh clone there: {make}"
