"""The link of an emulated device: its own network namespace, joined to the head (this
machine's own stack) by a veth pair whose bandwidth ``tc`` holds (``tbf``, both ways), with
the round trip added by a ``DelayRelay`` (``libs/cluster/relay.py``; this kernel has no
``netem``) in front of NATS.

The device's worker runs in the namespace (``prefix``) and reaches NATS only through the relay,
at the head's end of the veth: everything it says and hears on the bus (its telemetry, its
tokens, the torch ring's hidden states) crosses the link's bandwidth and delay. Its llama.cpp
RPC server listens on its own end (``RPC_PORT``), and the head reaches it through a second
relay at the head's end (``rpc_address``, which the worker announces): a split's RPC traffic
crosses the same bandwidth and delay. Needs root and iproute2; ``unavailable()`` says why not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The port a linked device's llama.cpp RPC server listens on, on its own end of the link (its
#: namespace is its own: nothing else holds it).
RPC_PORT = 50052


def unavailable() -> str | None:
    """Why links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "links need root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"links need iproute2 and util-linux ({', '.join(missing)} not found)"
    return None


def run_tool(*argv: str) -> None:
    """Run ``argv`` (``ip …``, ``tc …``); a refusal raises ``RuntimeError`` with what it said."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def ip(*args: str) -> None:
    run_tool("ip", *args)


def end_host(namespace: str) -> list[str]:
    """Switch the host ``namespace`` off: SIGKILL whatever still runs there, then delete the
    namespace (deleting alone leaves its processes running: a relay blocked on a link that is
    down waits for TCP to give up, a quarter of an hour). Returns the commands it killed."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    killed = []
    for pid in listed.stdout.split():
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            os.kill(int(pid), signal.SIGKILL)
            killed.append(command.decode(errors="replace").strip())
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    return killed


def shape(device: str, mbit: float, namespace: str | None = None) -> None:
    """Hold what ``device`` sends to ``mbit`` (a token bucket a few milliseconds deep)."""
    rate = f"{mbit * 1000:.0f}kbit"
    burst = f"{max(1600, int(mbit * 1e6 / 8 / 250))}"  # 4 ms of traffic, at least a frame
    where = ["-n", namespace] if namespace else []
    bucket = ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]
    run_tool("tc", *where, "qdisc", "replace", "dev", device, "root", *bucket)


class LinkedHost:
    """One device's namespace, veth and relay: ``create`` makes them, ``remove`` undoes them.

    ``index`` (0–63) picks the /30 of ``10.<subnet>.<4 × index>``: the head's end ``.1``, the
    device's ``.2``."""

    def __init__(self, tag: str, index: int, subnet: int, rtt_ms: float, mbit: float) -> None:
        if not 0 <= index < 64:
            raise ValueError(f"at most 64 links: index {index}")
        self.namespace = f"tl{tag}{index}"
        self.head_end, self.device_end = f"th{tag}{index}", f"td{tag}{index}"
        base = 4 * index
        self.head_address = f"10.{subnet}.{base // 256}.{base % 256 + 1}"
        self.address = f"10.{subnet}.{base // 256}.{base % 256 + 2}"
        #: The round trip the link adds (ms, half each way) and its bandwidth each way (Mbit/s).
        self.rtt_ms, self.mbit = rtt_ms, mbit
        self.relay: subprocess.Popen[str] | None = None
        self.rpc_relay: subprocess.Popen[str] | None = None
        self.relay_port = self.rpc_relay_port = 0
        self.relays: list[subprocess.Popen[str]] = []  # every relay started, to stop

    def create(self, nats_target: str) -> LinkedHost:
        """The namespace, the shaped veth, and the relay to ``nats_target`` (host:port)."""
        ns = self.namespace
        ip("netns", "add", ns)
        ip("link", "add", self.head_end, "type", "veth", "peer", "name", self.device_end)
        ip("link", "set", self.device_end, "netns", ns)
        ip("addr", "add", f"{self.head_address}/30", "dev", self.head_end)
        ip("link", "set", self.head_end, "up")
        ip("-n", ns, "addr", "add", f"{self.address}/30", "dev", self.device_end)
        ip("-n", ns, "link", "set", self.device_end, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        shape(self.head_end, self.mbit)  # head to device
        shape(self.device_end, self.mbit, ns)  # device to head
        self.relay, self.relay_port = self._relay(nats_target)
        # The head's RPC traffic to the device's llama.cpp RPC server, delayed the same way.
        self.rpc_relay, self.rpc_relay_port = self._relay(f"{self.address}:{RPC_PORT}")
        return self

    def _relay(self, target: str) -> tuple[subprocess.Popen[str], int]:
        """A relay on the head's end of the link to ``target`` (host:port), ``rtt_ms / 2``
        late each way: the process and its port."""
        argv = [sys.executable, "-m", "libs.cluster.relay", self.head_address, target]
        relay = subprocess.Popen(
            [*argv, str(self.rtt_ms / 2)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.relays.append(relay)
        assert relay.stdout is not None
        line = relay.stdout.readline()
        if not line:
            raise RuntimeError(f"the relay of {self.namespace} to {target} did not start")
        return relay, int(json.loads(line)["port"])

    @property
    def rpc_address(self) -> str:
        """Where the head reaches the device's RPC server (through its relay), host:port."""
        return f"{self.head_address}:{self.rpc_relay_port}"

    @property
    def nats_address(self) -> str:
        """Where the device reaches NATS (the relay), host:port."""
        return f"{self.head_address}:{self.relay_port}"

    def prefix(self) -> list[str]:
        """Runs a command in the namespace's network: ``nsenter``, not ``ip netns exec``, which
        also mounts a /sys of its own (without the cgroups a held worker reads its limit in)."""
        return ["nsenter", f"--net=/var/run/netns/{self.namespace}"]

    def remove(self) -> None:
        """Stop the relays, kill what still runs in the namespace, delete it (and its veth)."""
        for relay in self.relays:
            if relay.stdin is not None:
                relay.stdin.close()
            try:
                relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
        self.relays.clear()
        end_host(self.namespace)
        subprocess.run(["ip", "link", "del", self.head_end], capture_output=True)
