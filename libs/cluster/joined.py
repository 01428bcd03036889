"""``tessera join`` in the foreground: this host becomes a device of a cluster elsewhere.

Asks the cluster for a user of this device's own (``libs/cluster/joining.py``), then runs a
worker whose device is this host (``TESSERA_WORKER_HOST_DEVICE``: its real memory and readings,
its calibrated speed) until Ctrl-C or SIGTERM, printing its log lines.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.text import Text

from libs.cluster.child_output import exit_text, render
from libs.cluster.discovery import find_clusters
from libs.cluster.engine_choice import Built, EngineMissing, joined_engine
from libs.cluster.joining import JoinRefused, ask_to_join
from libs.cluster.stopping import stopped_by_signals
from libs.devices.host_device import host_device_id
from libs.runtime.pki import Credentials, rpc_env
from libs.runtime.procs import ServiceProcess


@dataclass
class JoinOptions:
    #: The cluster's NATS URL; None: the first cluster found on the LAN (mDNS).
    url: str | None
    token: str
    device_id: str | None = None
    #: What the scheduler may place here (GB); default: this host's memory.
    memory_gb: float | None = None
    #: ``llamacpp``, ``torch`` or ``vllm``; None: by the rule of ``joined_engine`` (llama.cpp
    #: where built).
    engine: str | None = None
    #: The cluster's CA: NATS over TLS, trusting only it (None: plain TCP).
    ca_file: Path | None = None
    ready_timeout_s: float = 180.0


def local_address(url: str) -> str:
    """This host's address on the route to ``url``'s host (no packet is sent)."""
    first = urlsplit(url.split(",")[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((first.hostname or "127.0.0.1", first.port or 4222))
        return str(sock.getsockname()[0])


#: Said when the cluster keeps refusing this host's secret.
REFUSED = (
    "the cluster at {url} refuses this host's secret (NATS: authorization violation): "
    "{device_id} was revoked there, or the cluster was started over (`tessera up --fresh`). "
    "Nothing here was deleted. To serve it again, ask its owner for the join command "
    "(`tessera token rotate` prints a new token) and run `tessera join` with it"
)


class Refusals:
    """Counts the worker's reconnects refused for their credentials: ``LIMIT`` in a row
    (none accepted between) means the secret is no longer the cluster's."""

    LIMIT = 3

    def __init__(self) -> None:
        self.count = 0

    def hear(self, line: dict[str, object]) -> None:
        if line.get("msg") == "nats reconnected":
            self.count = 0
        elif line.get("msg") == "nats error" and "authorization" in str(line.get("error")).lower():
            self.count += 1

    def refused(self) -> bool:
        return self.count >= self.LIMIT


def run_joined(options: JoinOptions, console: Console | None = None) -> int:
    """Exit 0 after Ctrl-C/SIGTERM; 1 when the cluster cannot be reached or refuses, or the
    worker dies; 2 when ``--engine`` names an engine this host has not built."""
    out = console or Console(highlight=False)

    def say(message: str, style: str = "white") -> None:
        line = Text("      join │ ", style="cyan")
        line.append(message, style=style)
        out.print(line, soft_wrap=True)

    try:  # before asking to join: an engine this host cannot run joins nothing
        engine, why = joined_engine(options.engine, Built.here())
    except EngineMissing as exc:
        say(f"--engine {options.engine}: {exc}", "bold red")
        return 2
    device_id = options.device_id or host_device_id()
    url = options.url
    if url is None:
        found = find_clusters()
        if not found:
            say("no cluster announces itself on this LAN (mDNS): give its URL", "bold red")
            return 1
        url = found[0]
        others = f" (also found: {', '.join(found[1:])})" if found[1:] else ""
        say(f"found {url} on the LAN{others}")
    # This device's key and the certificate the cluster signs for it (llama.cpp's RPC
    # channel, libs/runtime/pki.py): made for this run only, removed when it ends.
    rpc_folder = Path(tempfile.mkdtemp(prefix="tessera-rpc-"))
    try:
        nats_url = asyncio.run(
            ask_to_join(url, options.token, device_id, options.ca_file, rpc_folder=rpc_folder)
        )
    except JoinRefused as exc:
        shutil.rmtree(rpc_folder, ignore_errors=True)
        say(str(exc), "bold red")
        return 1
    link = "TLS" if options.ca_file is not None else "plain TCP: no CA given"
    say(f"joined {url} as device {device_id} ({link}); engine {engine} ({why})")
    env = {  # on top of this process's environment, with JSON logs (ServiceProcess)
        "TESSERA_NATS_URL": nats_url,
        "TESSERA_WORKER_DEVICE_ID": device_id,
        "TESSERA_WORKER_HOST_DEVICE": "true",
        "TESSERA_WORKER_ENGINE": engine,
        "TESSERA_WORKER_PRELOAD": "true",
    }
    if engine == "llamacpp":  # the head of a split reaches this host's RPC server here
        env["TESSERA_WORKER_RPC_HOST"] = address = local_address(nats_url)
        rpc = Credentials.in_folder(rpc_folder)
        if rpc.exist():
            env.update(rpc_env(rpc))
            say(f"llama.cpp's RPC server listens on {address} (mutual TLS, the cluster's CA)")
        else:
            say(f"llama.cpp's RPC server listens on {address}: no certificate from the cluster")
    if options.memory_gb is not None:
        env["TESSERA_WORKER_MEMORY_GB"] = str(options.memory_gb)
    if options.ca_file is not None:
        env["TESSERA_NATS_CA"] = str(options.ca_file.resolve())
    refusals = Refusals()

    def heard(line: dict[str, object]) -> None:
        say(render(line))
        refusals.hear(line)

    worker = ServiceProcess("worker", env, ["-m", "services.worker"], on_line=heard)

    with stopped_by_signals():
        try:
            worker.start(ready_timeout_s=None)
            if not worker.wait_ready(options.ready_timeout_s):
                say(f"the worker did not start: {exit_text(worker.returncode)}", "bold red")
                return 1
            say(f"ready: this host serves as {device_id}; Ctrl-C leaves", "bold green")
            while worker.alive:
                if refusals.refused():
                    say(REFUSED.format(device_id=device_id, url=url), "bold red")
                    return 1
                time.sleep(0.2)
            say(f"the worker {exit_text(worker.returncode)}", "bold red")
            return 1
        except KeyboardInterrupt:
            say("leaving")
            return 0
        finally:
            worker.terminate()
            worker.stop(timeout_s=30)
            shutil.rmtree(rpc_folder, ignore_errors=True)
