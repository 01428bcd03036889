"""Run `tessera up` as a user would, and look at its process tree."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from libs.runtime.proc_tree import alive, descendants, process_with_env
from libs.runtime.procs import ServiceProcess, free_port
from services.worker.settings import WorkerSettings

__all__ = ["NEEDS_LLAMA", "RunningCluster", "alive", "descendants", "process_with_env"]

#: A test of clusters on llama.cpp: skipped, saying why, where `make llama` has not built it.
NEEDS_LLAMA = pytest.mark.skipif(
    not (WorkerSettings().llama_bin / ".installed").exists(),
    reason="no llama.cpp build: `make llama`",
)


class RunningCluster:
    """``tessera up`` in a subprocess (``python -m libs.cli.main up``), its output kept. Its
    home is ``home``, else a new temporary folder (each test's cluster starts new)."""

    def __init__(
        self,
        *args: str,
        devices: int = 0,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        home: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.run_file = Path(tempfile.mkdtemp()) / "cluster.json"
        self.home = home or Path(tempfile.mkdtemp(prefix="tessera-home-"))
        env = {
            "TESSERA_HOME": str(self.home),
            "TESSERA_GATEWAY_PORT": str(self.port),
            "TESSERA_RUN_FILE": str(self.run_file),
            "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
            "COLUMNS": "200",
            **(env or {}),
        }
        argv = ["-m", "libs.cli.main", "up", "--devices", str(devices), *args]
        self.child = ServiceProcess("tessera up", env, argv, prefix=prefix)
        self.child.start(ready_timeout_s=None)
        assert self.child.process is not None
        self.process = self.child.process

    @property
    def lines(self) -> list[str]:
        return [str(line.get("msg", line)) for line in self.child.lines]

    def wait_for(self, text: str, timeout_s: float = 120.0) -> str:
        try:
            line = self.child.wait_for(lambda line: text in str(line.get("msg", "")), timeout_s)
        except TimeoutError:
            tail = "\n".join(self.lines[-60:])
            raise AssertionError(f"no line with {text!r}; output:\n{tail}") from None
        return str(line["msg"])

    def join_command(self) -> tuple[str, str]:
        """The NATS address and token of the join command a ``--listen`` cluster prints, once
        it is ready."""
        said = self.wait_for("other hosts join with:", 60)
        found = re.search(r"tessera join (\S+) --token (\S+)", said)
        assert found, said
        self.wait_for("ready:", 240)
        return found[1], found[2]

    def exit_code(self, timeout_s: float) -> int:
        """Its exit status once it exits; past ``timeout_s``, its threads' stacks (SIGUSR1:
        ``tessera up`` prints them) and its last lines in the failure."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(self.where(f"still running after {timeout_s:.0f} s")) from None

    def interrupt(self, timeout_s: float) -> int:
        """Ctrl-C, and its exit status (``exit_code``)."""
        self.process.send_signal(signal.SIGINT)
        return self.exit_code(timeout_s)

    def where(self, what: str) -> str:
        """``what``, with each thread's signal masks, its stacks and its last lines."""
        masks = signal_masks(self.process.pid)  # before SIGUSR1 is handled
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        tail = "\n".join(self.lines[-80:])
        return f"{what} ({masks}):\n{tail}"

    def tessera(
        self, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """A ``tessera`` command against this cluster (its run file), with ``env`` added to
        this process's: the exit status and its output, stdout and stderr, on one line."""
        env = {
            **os.environ,
            "TESSERA_RUN_FILE": str(self.run_file),
            "COLUMNS": "200",
            **(env or {}),
        }
        done = subprocess.run(
            [sys.executable, "-m", "libs.cli.main", *args],
            env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        return done.returncode, " ".join((done.stdout + done.stderr).split())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.child.stop(timeout_s=30)


def signal_masks(pid: int) -> str:
    """Each thread's pending, blocked and caught signals (``/proc``), to tell a signal never
    delivered from one delivered and not acted on."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            status = (task / "status").read_text().splitlines()
        except OSError:
            continue
        wanted = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        found.append(f"{task.name}: " + " ".join(x for x in status if x.startswith(wanted)))
    return "; ".join(found)
