"""A process tree read from /proc: what runs below a ``tessera up``, found as a user finds it
(``ps``), for the chaos harness and the tests that kill one of its processes."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
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
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


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


def unit_pid(root: int, name: str, port: int | None = None) -> int:
    """The process of ``name`` below ``root`` (a ``tessera up``): a service (``scorer``,
    ``scheduler``, …), a worker by its device id (``worker-1``), ``redis``, or ``nats`` (or
    ``nats-0``, … with ``port``: the nats-server listening there, one of a NATS cluster).
    ``LookupError`` if there is none."""
    for pid in sorted(descendants(root)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            program = Path(f"/proc/{pid}/comm").read_text().strip()  # Redis rewrites its argv
        except OSError:
            continue
        if name == "redis" or name.partition("-")[0] == "nats":
            server = f"{name.partition('-')[0]}-server"
            if program == server and (port is None or str(port).encode() in argv):
                return pid
        elif name.startswith("worker-"):
            if b"services.worker" in argv and f"TESSERA_WORKER_DEVICE_ID={name}".encode() in env:
                return pid
        elif f"services.{name}".encode() in argv:
            return pid
    raise LookupError(f"no process of {name} under {root}")
