"""Run `tessera up` as a user would, and look at its process tree."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from libs.runtime.procs import free_port

BIN = Path(sys.executable).parent


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


class RunningCluster:
    """``tessera up`` in a subprocess, its output collected line by line."""

    def __init__(self, *args: str, devices: int = 0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self.run_file = Path(tempfile.mkdtemp()) / "cluster.json"
        env = dict(
            os.environ,
            TESSERA_GATEWAY_PORT=str(self.port),
            TESSERA_RUN_FILE=str(self.run_file),
            TESSERA_SCHEDULER_HTTP_PORT=str(free_port()),
            COLUMNS="200",
            **(env or {}),
        )
        self.process = subprocess.Popen(
            [str(BIN / "tessera"), "up", "--devices", str(devices), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            self._queue.put(line)

    def wait_for(self, text: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}; output:\n" + "\n".join(self.lines[-60:]))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def process_with_env(root: int, key: str, value: str) -> int | None:
    """The descendant of ``root`` whose environment has ``key=value``."""
    wanted = f"{key}={value}".encode()
    for pid in descendants(root):
        try:
            if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None
