"""llama.cpp's RPC between hosts, through mutual TLS: ``socat`` at both ends.

``ggml-rpc-server`` takes no credentials (llama.cpp's README: never on an open network), so it
listens on 127.0.0.1 only. A device that lends it to other hosts runs a TLS listener on its LAN
address (``Listener``) that forwards each connection to it, and accepts only a peer presenting
a certificate the cluster's CA signed (``libs/runtime/pki.py``) for a device that is the head
of a placement this device lends to (``Listener.admit``, told by the worker as its tasks come
and go); anything else — plain TCP, a certificate of another CA or of another device (a
revoked one among them), none — ends in a failed handshake and never reaches the server. The
head of a split reaches each remote RPC server through a tunnel (``tunnel``) on its own
loopback: llama-server connects there, the tunnel opens TLS to the device with the head's
certificate and checks that the other end's certificate names the device the placement routes
to (``commonname``), so a host that took a device's address cannot pose as it.

socat is a C relay from Debian (``make deps``): one process per connection (``fork``), TLS 1.3,
Nagle off on every socket (llama.cpp's RPC is many small round trips per token). Each relay is
a child in a process group of its own, stopped with its forked connections (``killpg``); when the
worker dies it gets SIGKILL, and its connections end with the servers they relay to.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from libs.runtime.pki import Credentials
from libs.runtime.procs import child_kwargs, free_port

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: Both ends: TLS 1.3 only, Nagle off.
TLS_OPTIONS = "verify=1,min-version=TLS1.3,nodelay"
#: What a device id is (``libs/contracts``' token pattern): safe in socat's options and a shell.
DEVICE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The name a listener lending to no head checks for: no certificate the cluster issues
#: names it (device ids have no dot), so it lets nobody in.
NOBODY = "no-head.invalid"


class ChannelError(RuntimeError):
    """A relay could not start (socat missing, a port taken, bad files); the message says why."""


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def is_own_address(host: str) -> bool:
    """Whether ``host`` is an address of this host (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


def _files(credentials: Credentials) -> str:
    for path in (credentials.ca, credentials.cert, credentials.key):
        if any(c in str(path) for c in ",:!'\"\\ ") or not path.exists():
            raise ChannelError(f"{path}: missing, or a name socat cannot take (, : ! quotes)")
    return f"cafile={credentials.ca},cert={credentials.cert},key={credentials.key}"


def listener_command(
    credentials: Credentials,
    host: str,
    port: int,
    target_port: int,
    heads: Sequence[str] = (),
    check: Path | None = None,
) -> list[str]:
    """socat: TLS on ``host:port`` → the RPC server on loopback, for a peer whose cluster
    certificate names one of ``heads`` (none: nobody). One head is checked by socat itself
    (``commonname``); several by the shell script ``check`` each connection runs, which
    relays only for a named one (``check_script``): one more hop, for a case that is rare
    (llama.cpp's RPC server serves one client at a time)."""
    tls = f"OPENSSL-LISTEN:{port},bind={host},reuseaddr,fork,{_files(credentials)},{TLS_OPTIONS}"
    target = f"TCP:{LOOPBACK}:{target_port},nodelay"
    names = sorted(set(heads))
    for name in names:
        if not DEVICE_NAME.match(name):
            raise ChannelError(f"{name!r} is not a device id")
    if len(names) <= 1:
        return ["socat", f"{tls},commonname={names[0] if names else NOBODY}", target]
    if check is None or not check.exists() or any(c in str(check) for c in ",:!'\"\\ "):
        raise ChannelError(f"several heads need a script to check them, not {check}")
    return ["socat", tls, f"SYSTEM:sh {check}"]


def check_script(heads: Sequence[str], target_port: int) -> str:
    """The shell script a connection runs under a listener for several heads: socat gives it
    the peer's certificate name (``SOCAT_OPENSSL_X509_COMMONNAME``, verified by then); it
    relays to the RPC server only for one of ``heads`` (device ids: no shell characters)."""
    names = "|".join(sorted(set(heads)))
    relay = f"exec socat STDIO TCP:{LOOPBACK}:{target_port},nodelay"
    return f'case "$SOCAT_OPENSSL_X509_COMMONNAME" in\n  {names}) {relay} ;;\nesac\nexit 1\n'


def tunnel_command(
    credentials: Credentials, local_port: int, endpoint: str, device_id: str
) -> list[str]:
    """socat: plain TCP on loopback ``local_port`` → TLS to ``endpoint``, whose certificate
    must be the cluster's and name ``device_id``."""
    host, port = endpoint.rsplit(":", 1)
    return [
        "socat",
        f"TCP-LISTEN:{local_port},bind={LOOPBACK},reuseaddr,fork,nodelay",
        f"OPENSSL:{host}:{port},{_files(credentials)},{TLS_OPTIONS},commonname={device_id}",
    ]


class Relay:
    """One socat child listening on ``host:port`` until ``stop``."""

    def __init__(self, command: list[str], host: str, port: int) -> None:
        self.command, self.host, self.port = command, host, port
        self.proc: asyncio.subprocess.Process | None = None
        self._errors: asyncio.Future[None] | None = None
        self._orphans = False  #: its listener stopped, its connections left running

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> Relay:
        if shutil.which(self.command[0]) is None:
            raise ChannelError(f"{self.command[0]} not found: install it with `make deps`")
        self.proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            **child_kwargs(signal.SIGKILL),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                said = b"" if self.proc.stderr is None else await self.proc.stderr.read(2000)
                raise ChannelError(f"socat exited with {self.proc.returncode}: {said.decode()}")
            if listening(self.port, self.host):
                self._errors = asyncio.ensure_future(self._read_errors())
                return self
            await asyncio.sleep(0.05)
        await self.stop()
        raise ChannelError(f"socat did not listen on {self.address} in {timeout_s} s")

    async def _read_errors(self) -> None:
        """socat's own errors (a refused peer's failed handshake), logged at debug."""
        if self.proc is None or self.proc.stderr is None:
            return
        async for line in self.proc.stderr:
            log.debug("rpc channel", extra={"socat": line.decode(errors="replace").strip()})

    async def stop_listening(self) -> None:
        """SIGTERM to the listening socat only: it frees the port; the connections it forked
        go on (``stop`` ends them)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._orphans = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)

    async def stop(self) -> None:
        """SIGTERM to its whole group (the listener and its forked connections)."""
        proc, self.proc = self.proc, None
        if self._errors is not None:
            self._errors.cancel()
        if proc is not None and proc.returncode is not None and self._orphans:
            with contextlib.suppress(ProcessLookupError):  # its connections, if any still run
                os.killpg(proc.pid, signal.SIGTERM)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def listening(port: int, host: str | None = None) -> bool:
    """Whether a socket of this network namespace listens on TCP ``port`` (IPv4), on ``host``
    where given (the RPC server listens on loopback at its TLS listener's port number, so the
    listener's own address must be asked for). Read from ``/proc/net/tcp``, not by
    connecting: a connection to a tunnel would open one to the device behind it."""
    with open("/proc/net/tcp") as table:
        for row in table.readlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, at = local.rsplit(":", 1)
            if state != "0A" or int(at, 16) != port:
                continue
            bound = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
            if host is None or not _ipv4(host) or bound in (host, "0.0.0.0"):
                return True
    return False


def _ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False  # a name: any address of the port will do


class Listener:
    """The lending side's TLS listener on ``host:port``, for the RPC server on loopback
    ``target_port``: it lets in only the heads ``admit`` names, and follows them as they
    change (a new socat; the old one's connections end with it, unless every head it
    admitted still is)."""

    def __init__(self, credentials: Credentials, host: str, port: int, target_port: int) -> None:
        self.credentials, self.host, self.port = credentials, host, port
        self.target_port = target_port
        self.heads: tuple[str, ...] = ()
        self.relay: Relay | None = None
        self._kept: list[Relay] = []  #: old listeners' connections of heads still admitted
        self._folder: Path | None = None  #: the scripts checking several heads, when made

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _relay(self) -> Relay:
        check = None
        if len(self.heads) > 1:
            self._folder = self._folder or Path(tempfile.mkdtemp(prefix="rpc-listener-"))
            check = self._folder / f"check-{len(self._kept)}"
            check.write_text(check_script(self.heads, self.target_port))
        command = listener_command(
            self.credentials, self.host, self.port, self.target_port, self.heads, check
        )
        return Relay(command, self.host, self.port)

    async def start(self, timeout_s: float = 10.0) -> Listener:
        self.relay = await self._relay().start(timeout_s)
        return self

    async def admit(self, heads: Iterable[str]) -> None:
        """Let in only ``heads`` (device ids) from now on."""
        wanted = tuple(sorted(set(heads)))
        if wanted == self.heads:
            return
        kept = set(self.heads) <= set(wanted)
        self.heads = wanted
        old, self.relay = self.relay, None
        if old is not None and kept:
            await old.stop_listening()
            self._kept.append(old)
        elif old is not None:
            await close_all([old, *self._kept])
            self._kept = []
        self.relay = await self._relay().start()
        log.info("rpc listener admits", extra={"heads": list(wanted)})

    async def stop(self) -> None:
        old, self.relay = self.relay, None
        await close_all([*([old] if old is not None else []), *self._kept])
        self._kept = []
        folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def listener(credentials: Credentials, host: str, port: int, target_port: int) -> Listener:
    """The listener for an RPC server lent to nobody yet (``Listener.admit``)."""
    return Listener(credentials, host, port, target_port)


def tunnel(credentials: Credentials, endpoint: str, device_id: str) -> Relay:
    port = free_port(LOOPBACK)
    return Relay(tunnel_command(credentials, port, endpoint, device_id), LOOPBACK, port)


async def open_tunnels(
    credentials: Credentials | None, endpoints: Sequence[str], devices: Sequence[str]
) -> tuple[list[str], list[Relay]]:
    """The addresses llama-server is given for ``endpoints`` (of ``devices``, in route
    order), and the tunnels opened for them. A device on this very host is reached on
    loopback (its RPC server listens there on the port number of its TLS listener, see
    ``RpcServer``); any other through a tunnel, never in the clear: so is one at an address
    of this host with nothing on that loopback port (a fleet's linked device in a network
    namespace of its own, behind its link's relay)."""
    addresses: list[str] = []
    relays: list[Relay] = []
    try:
        for endpoint, device_id in zip(endpoints, devices, strict=True):
            host, port = endpoint.rsplit(":", 1)
            if is_loopback(host) or (is_own_address(host) and listening(int(port), LOOPBACK)):
                addresses.append(f"{LOOPBACK}:{port}")
                continue
            if credentials is None:
                raise ChannelError(
                    f"{device_id}'s RPC server is on another host ({endpoint}) and this device "
                    "has no cluster certificate to reach it with (join the cluster again)"
                )
            relays.append(await tunnel(credentials, endpoint, device_id).start())
            addresses.append(relays[-1].address)
    except BaseException:
        await close_all(relays)
        raise
    return addresses, relays


async def close_all(relays: Sequence[Relay]) -> None:
    for relay in relays:
        await relay.stop()
