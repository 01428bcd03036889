"""A LAN of hosts on this machine (tests and benchmarks of llama.cpp's RPC channel).

This machine's own network stack is one host (the head: the process that asks); every other
host is a network namespace whose veth joins a bridge on this one, so all of them share one
layer-2 segment, as laptops on one switch do, with no loopback between them. Needs root and
iproute2 (``ip netns``: a process run in a namespace sees only that namespace's addresses).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from libs.cluster.links import end_host, ip

REPO = Path(__file__).resolve().parents[2]
#: Why a LAN cannot be made here (None: it can).
UNAVAILABLE = (
    "a LAN of namespaces needs root and iproute2"
    if os.geteuid() != 0 or shutil.which("ip") is None
    else None
)


@dataclass(frozen=True)
class Host:
    #: Runs a command on this host (``ip netns exec NS``).
    prefix: list[str]
    address: str


@dataclass(frozen=True)
class Lan:
    #: This machine's address on the LAN (the head's).
    address: str
    hosts: list[Host]


@contextmanager
def lan(hosts: int) -> Iterator[Lan]:
    """A bridge with this machine at ``.1`` and ``hosts`` namespaces at ``.2``, ``.3``, …"""
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.{250 + int(tag[:2], 16) % 5}.{int(tag[2:4], 16)}"
    bridge, names = f"br{tag}", [f"h{i}{tag}" for i in range(hosts)]
    # Where Docker runs, frames crossing a bridge go through iptables' FORWARD chain, whose
    # policy Docker sets to DROP: this LAN's own frames are let through while it lives.
    forward = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    iptables = shutil.which("iptables")
    try:
        ip("link", "add", bridge, "type", "bridge")
        if iptables:
            subprocess.run([iptables, "-I", *forward], capture_output=True)
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        made = []
        for i, ns in enumerate(names):
            ip("netns", "add", ns)
            ip("link", "add", f"v{ns}", "type", "veth", "peer", "name", f"p{ns}")
            ip("link", "set", f"p{ns}", "master", bridge)
            ip("link", "set", f"p{ns}", "up")
            ip("link", "set", f"v{ns}", "netns", ns)
            ip("-n", ns, "addr", "add", f"{subnet}.{i + 2}/24", "dev", f"v{ns}")
            ip("-n", ns, "link", "set", f"v{ns}", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            made.append(Host(["ip", "netns", "exec", ns], f"{subnet}.{i + 2}"))
        yield Lan(f"{subnet}.1", made)
    finally:
        for ns in names:
            end_host(ns)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        if iptables:
            subprocess.run([iptables, "-D", *forward], capture_output=True)


@contextmanager
def lender(
    host: Host,
    binaries: Path,
    credentials_folder: Path | None,
    threads: int = 1,
    heads: Sequence[str] = (),
) -> Iterator[dict[str, object]]:
    """Tessera's RPC server on ``host`` (mutual TLS on its address with the credentials in
    ``credentials_folder``, for the devices ``heads`` only; None: loopback only), until the
    block ends."""
    folder = str(credentials_folder) if credentials_folder is not None else ""
    # The worker's own lender entry point (the harness only starts it: it imports no service).
    argv = [sys.executable, "-m", "services.worker.rpc.lender", host.address, folder, str(binaries)]
    argv.append(str(threads))
    argv.append(",".join(heads))
    proc = subprocess.Popen(
        [*host.prefix, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the RPC server on {host.address} did not start")
        yield json.loads(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
