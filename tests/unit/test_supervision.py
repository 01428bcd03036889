"""When `tessera up` starts an exited service again (``libs/cluster/supervision.py``): after a
doubling backoff, and never more than five times in two minutes."""

from __future__ import annotations

from libs.cluster.supervision import BURST, MAX_BACKOFF_S, WINDOW_S, ServiceState, Supervisor


def test_each_restart_waits_twice_as_long_and_a_sixth_crash_in_the_window_fails_it() -> None:
    watch = Supervisor()
    waits = []
    for i in range(BURST):
        waits.append(watch.exited("gateway", "killed by SIGKILL", now=float(i)))
        watch.restarted("gateway", now=float(i))
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert watch.exited("gateway", "exited with code 1", now=float(BURST)) is None
    assert watch.failed("gateway")
    assert watch.report()["gateway"] == {
        "state": "failed",
        "restarts": BURST,
        "last_exit": "exited with code 1",
    }


def test_crashes_further_apart_than_the_window_start_over_and_the_wait_is_capped() -> None:
    watch = Supervisor()
    for i in range(3 * BURST):
        now = i * WINDOW_S
        assert watch.exited("scorer", "exited with code 1", now) == 0.5
        watch.restarted("scorer", now)
    assert not watch.failed("scorer") and watch.report()["scorer"]["restarts"] == 3 * BURST
    busy = Supervisor({"x": ServiceState(recent=[0.0] * 9)})  # more than a burst, long ago
    assert busy.exited("x", "", WINDOW_S + 1) == 0.5
    capped = Supervisor({"x": ServiceState(recent=[0.0] * 4)})
    assert capped.exited("x", "", 1.0) == min(MAX_BACKOFF_S, 8.0)
