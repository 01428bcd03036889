"""The run file: where a running `tessera up` cluster's servers listen, for `tessera devices`
and the other commands given no address.

A cluster holds an exclusive ``flock`` on its run file for its whole life; the kernel drops
the lock when the process exits, however it exits. So a file is live exactly while someone
holds its lock: a pid that is still there (a process not yet reaped, or the pid reused) proves
nothing, and a file left by a killed cluster is taken over by the next one.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any


def _locked(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def held(path: Path) -> bool:
    """Whether a live cluster holds ``path`` (False for a missing or a stale file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return not _locked(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # closing drops the shared lock taken to test it


def claim(preferred: Path) -> tuple[Path, int]:
    """Lock ``preferred`` for this process, or ``<stem>-<pid><suffix>`` beside it when a live
    cluster holds it (commands given no address keep finding that one). Returns the path and
    the open, locked descriptor: keep it open while the cluster runs."""
    preferred.parent.mkdir(parents=True, exist_ok=True)
    own = preferred.with_name(f"{preferred.stem}-{os.getpid()}{preferred.suffix}")
    for path in (preferred, own):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # it holds the admin's passwords
        if _locked(fd, fcntl.LOCK_EX):
            os.fchmod(fd, 0o600)
            return path, fd
        os.close(fd)
    raise RuntimeError(f"{own} is locked by another process")


def write(fd: int, contents: dict[str, Any]) -> None:
    """Replace the claimed file's contents (through the locked descriptor): written over,
    then cut to its length, so a reader never finds it empty (``read`` reads again a file
    caught mid-write)."""
    data = json.dumps(contents).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def release(path: Path, fd: int) -> None:
    """The cluster stops: the file goes, then the lock."""
    path.unlink(missing_ok=True)
    os.close(fd)


def read(path: Path) -> dict[str, Any]:
    """What the live cluster of ``path`` recorded; ``SystemExit`` with the reason when none
    runs (no file, or a file whose cluster is gone)."""
    if not path.exists():
        raise SystemExit(
            f"no running cluster found ({path} is missing): start one with `make up`, "
            "or pass its address"
        )
    if not held(path):
        raise SystemExit(
            f"no running cluster found: {path} was left by a cluster that is gone; "
            "start one with `make up`, or pass its address"
        )
    for _ in range(20):  # the cluster may be rewriting it (what its services are doing)
        try:
            recorded: dict[str, Any] = json.loads(path.read_text())
            return recorded
        except ValueError:
            time.sleep(0.05)
    recorded = json.loads(path.read_text())
    return recorded
