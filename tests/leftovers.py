"""Processes a test run started that outlive it.

Every process the run starts inherits ``RUN_MARK`` in its environment (set at the start of the
run, so a child's child carries it too, whatever its parent), and another run on the same
machine carries another value. At the end of the run, any process carrying this run's mark
whose command is one of ``SERVERS`` (or a Tessera service, ``tessera up`` or ``tessera join``)
and that is still alive once ``GRACE_S`` has passed is a leftover: a test's teardown that did
not stop what it started."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

#: The environment variable that marks this run's processes (not ``TESSERA_…``: an engine's
#: environment is stripped of those, and the engines are among what must be found).
RUN_MARK = "TESTS_RUN_MARK"
#: The programs a test starts that must stop with it.
SERVERS = frozenset(
    {
        "nats-server",
        "redis-server",
        "llama-server",
        "ggml-rpc-server",
        "rpc-server",
        "socat",
        "prometheus",
        "prometheus-alertmanager",
        "chromedriver",
        "tessera",
    }
)
#: Python modules that are Tessera's own processes: the services, the CLI (``tessera up``,
#: ``join``), and vLLM's server under a vLLM worker.
MODULES = ("services.", "libs.cli.main", "vllm.entrypoints")
#: How long a process may take to exit after the last teardown stopped it (s).
GRACE_S = 15.0
FOUND = pytest.StashKey[list["Process"]]()


@dataclass(frozen=True)
class Process:
    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command[:300]}"


def mark_this_run() -> None:
    """Give this run a mark of its own (a run that a test starts gets a new one)."""
    os.environ[RUN_MARK] = uuid.uuid4().hex


def ours(environ: bytes) -> bool:
    return f"{RUN_MARK}={os.environ[RUN_MARK]}".encode() in environ.split(b"\0")


def is_server(argv: list[str]) -> bool:
    """Whether ``argv`` runs one of ``SERVERS`` or one of Tessera's ``MODULES``."""
    if not argv:
        return False
    if Path(argv[0]).name in SERVERS:
        return True
    modules = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    return any(m.startswith(MODULES) for m in modules)


def running() -> list[Process]:
    """This run's server processes alive now, except this one (zombies are gone already)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        argv = [a for a in argv if a]
        if ours(environ) and is_server(argv):
            found.append(Process(int(entry.name), " ".join(argv)))
    return sorted(found, key=lambda p: p.pid)


def still_running(grace_s: float = GRACE_S) -> list[Process]:
    """``running()`` once ``grace_s`` has passed, or at once when none is."""
    deadline = time.monotonic() + grace_s
    left = running()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = running()
    return left


def kill(processes: list[Process]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
