"""Child processes and ports: start a service (or any command) and wait for its ready line.

``ServiceProcess`` is the one way Tessera starts a child it waits on: ``tessera up``, the
harness's hand-placed workers and the tests all use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libs.runtime.lifecycle import READY_MESSAGE
from libs.runtime.settings import child_env

_PR_SET_PDEATHSIG = 1


def _die_with_parent(signum: int = signal.SIGTERM) -> None:  # pragma: no cover - in the child
    """Ask Linux to send ``signum`` to this child when its parent dies, so nothing is left
    behind (runs in the child between fork and exec)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)


def child_kwargs(death_signal: int = signal.SIGTERM) -> dict[str, Any]:
    """Keyword arguments for ``subprocess.Popen`` of a child that must not outlive us.

    The child gets its own process group, so a Ctrl-C at the terminal reaches only the parent,
    which then stops its children in order (services first, servers last). When the parent
    dies, the child gets ``death_signal``: SIGKILL for one whose SIGTERM can hang (llama.cpp's
    server waits on its open streams, and was found orphaned after its worker was killed).
    """
    return {"preexec_fn": functools.partial(_die_with_parent, death_signal), "process_group": 0}


#: Where ``free_port`` picks: from here up to the kernel's range for connections' own ports
#: (``EPHEMERAL``), never inside it. A port the kernel hands out (bind to 0) is in that range,
#: where any connection made before the server listens may take it as its source port: a
#: gateway was found failing to listen on a port picked a moment before for that reason.
PICK_FROM = 20_000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: A port picked is claimed for ``CLAIM_S`` by a file here, so that two processes picking at
#: once (two clusters side by side, each starting its services) never pick the same one in
#: the seconds before its server listens: a worker was found failing to listen for that reason.
CLAIMS = Path(tempfile.gettempdir()) / "tessera-ports"
CLAIM_S = 300.0
_picks = random.Random()  # its own: a test seeding the module's random does not seed this


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` and no other process of this machine picked in
    the last ``CLAIM_S``, below the range of connections' own ports."""
    below = _ephemeral_start()
    for _ in range(200 if below > PICK_FROM + 1000 else 0):
        port = _picks.randrange(PICK_FROM, below)
        if port_free(host, port, reuse=False) and _claim(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@functools.cache
def _ephemeral_start() -> int:
    """The first port of the kernel's range for connections' own ports (0: unknown)."""
    try:
        return int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _claim(port: int) -> bool:
    """Claim ``port`` (False: another process did within ``CLAIM_S``). Where no claim can be
    written (another user's folder), every port counts as unclaimed."""
    path = CLAIMS / str(port)
    try:
        CLAIMS.mkdir(mode=0o1777, exist_ok=True)
        if path.exists() and time.time() - path.stat().st_mtime >= CLAIM_S:
            path.unlink()  # an old claim: ours if no other process takes it first
    except FileNotFoundError:
        pass  # the old claim went meanwhile
    except OSError:
        return not path.exists()  # no folder of ours: unclaimed; another's old claim: taken
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def port_free(host: str, port: int, *, reuse: bool = True) -> bool:
    """Whether ``port`` can be listened on at ``host`` now, as servers listen (``reuse``:
    address reuse, the connections of a server just stopped, left in TIME_WAIT, do not hold
    it; without it they do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``host:port`` accepts connections; fail early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening")
        if port_open(host, port):
            return
        time.sleep(0.02)
    raise TimeoutError(f"{host}:{port} did not open within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, wait, then SIGKILL if needed. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


Line = dict[str, Any]
"""One line of a child's output: its JSON object, or ``{"msg": text}`` for a plain line."""


def is_ready(line: Line) -> bool:
    """The line a service logs once it serves (``libs.runtime.lifecycle.announce_ready``)."""
    return line.get("msg") == READY_MESSAGE


def parse_line(raw: bytes) -> Line:
    try:
        entry = json.loads(raw)
    except ValueError:
        return {"msg": raw.decode(errors="replace").rstrip()}
    return entry if isinstance(entry, dict) else {"msg": str(entry)}


class ServiceProcess:
    """``python -m services.<name>`` (or ``python *argv``) as a child that dies with us.

    Its output is read on a thread: each line is parsed (``parse_line``), kept in ``lines``,
    handed to ``on_line`` and offered to whoever waits in ``wait_for``; ``ready`` is set by the
    first line ``ready_line`` accepts. The environment is ours, with JSON logs, unbuffered
    output and ``env`` on top.
    """

    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        argv: Sequence[str] | None = None,
        *,
        ready_line: Callable[[Line], bool] = is_ready,
        on_line: Callable[[Line], None] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv or ["-m", f"services.{name}"])
        #: A command the Python process runs under (``ip netns exec NS`` for another "host").
        self.prefix = list(prefix)
        self.env = child_env(
            **{"TESSERA_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **(env or {})}
        )
        self.ready_line, self.on_line = ready_line, on_line
        self.lines: list[Line] = []
        self.ready = threading.Event()
        self._events: queue.Queue[Line] = queue.Queue()
        self.process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self, ready_timeout_s: float | None = 60.0) -> ServiceProcess:
        """Start; with ``ready_timeout_s``, wait for the ready line or raise ``RuntimeError``
        with the last lines of output."""
        self.lines.clear()
        self.ready.clear()
        self._events = queue.Queue()
        self.process = subprocess.Popen(
            [*self.prefix, sys.executable, *self.argv],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **child_kwargs(),
        )
        self._reader = threading.Thread(target=self._read, args=(self.process,), daemon=True)
        self._reader.start()
        if ready_timeout_s is not None and not self.wait_ready(ready_timeout_s):
            raise RuntimeError(f"{self.name} was not ready within {ready_timeout_s} s{self.tail()}")
        return self

    def _read(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            if not raw.strip():
                continue
            line = parse_line(raw)
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)
            if not self.ready.is_set() and self.ready_line(line):
                self.ready.set()
            self._events.put(line)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once ready; False if the process exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            if not self.alive or time.monotonic() > deadline:
                return self.ready.is_set()
        return True

    def wait_for(self, match: Callable[[Line], bool], timeout_s: float) -> Line:
        """The next line ``match`` accepts; ``TimeoutError`` (with the output's tail) if none
        comes within ``timeout_s`` or the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._events.get(timeout=0.1)
            except queue.Empty:
                if not self.alive:
                    break
                continue
            if match(line):
                return line
        raise TimeoutError(f"{self.name}: no matching line within {timeout_s} s{self.tail()}")

    def tail(self, count: int = 30) -> str:
        """The last lines of output (all of them, once a child that exited is read out)."""
        if not self.alive and self._reader is not None:
            self._reader.join(timeout=2)
        return "".join("\n" + json.dumps(line) for line in self.lines[-count:])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL, as a crash would, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self) -> None:
        """SIGTERM without waiting (``stop`` waits)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; the exit code (``None`` if never started)."""
        return None if self.process is None else stop_process(self.process, timeout_s)
