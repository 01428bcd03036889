"""Small helpers for child processes and ports."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM this child when its parent dies, so nothing is left behind."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``subprocess.Popen`` of a child that must not outlive us.

    The child gets its own process group, so a Ctrl-C at the terminal reaches only the parent,
    which then stops its children in order (services first, servers last).
    """
    return {"preexec_fn": _die_with_parent, "process_group": 0}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
