"""``ServiceProcess``, the one way a child is started and waited on (tessera up, the harness,
the tests): its lines, its ready line, its environment, and a clear error when it dies first."""

from __future__ import annotations

import random
import socket

import pytest

from libs.runtime import procs
from libs.runtime.procs import ServiceProcess

PRINT_READY = (
    "import json, os; print('starting up'); "
    "print(json.dumps({'msg': 'ready', 'format': os.environ['TESSERA_LOG_FORMAT']})); "
    "import time; time.sleep(30)"
)


def test_a_child_is_ready_on_its_ready_line_and_its_own_environment_wins() -> None:
    child = ServiceProcess("printer", {"TESSERA_LOG_FORMAT": "text"}, ["-c", PRINT_READY])
    child.start(ready_timeout_s=30)
    try:
        assert child.ready.is_set() and child.alive
        assert child.lines[0] == {"msg": "starting up"}  # a plain line, kept as text
        assert child.lines[1] == {"msg": "ready", "format": "text"}
    finally:
        assert child.stop(timeout_s=5) is not None
    assert not child.alive


def test_a_child_that_dies_before_ready_says_so_with_its_last_lines() -> None:
    child = ServiceProcess("crasher", {}, ["-c", "print('cannot bind'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"(?s)crasher was not ready.*cannot bind"):
        child.start(ready_timeout_s=30)
    assert child.returncode == 3


def test_a_free_port_is_one_no_outgoing_connection_can_take_before_it_is_listened_on() -> None:
    """Picked below the kernel's range for connections' own ports: a connection opened between
    the pick and the listen never takes it (as one took a gateway's port once)."""
    below = int(procs.EPHEMERAL.read_text().split()[0])
    ports = {procs.free_port() for _ in range(20)}
    assert all(procs.PICK_FROM <= port < below for port in ports), sorted(ports)
    assert len(ports) > 1  # not one port handed out again and again
    port = ports.pop()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert procs.free_port() != port  # a port listened on is not free


def test_two_processes_picking_alike_never_get_the_same_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two pickers drawing the same numbers (two clusters starting side by side) still get
    different ports: the first one's picks are claimed until their servers listen."""
    monkeypatch.setattr(procs, "_picks", random.Random(7))
    first = [procs.free_port() for _ in range(10)]
    monkeypatch.setattr(procs, "_picks", random.Random(7))  # the other process, same draws
    second = [procs.free_port() for _ in range(10)]
    assert not set(first) & set(second), (first, second)
