"""``ServiceProcess``, the one way a child is started and waited on (tessera up, the harness,
the tests): its lines, its ready line, its environment, and a clear error when it dies first."""

from __future__ import annotations

import pytest

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
