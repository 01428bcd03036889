"""The limits an enforced fleet's device runs under are real (``libs/cluster/limits.py``): the
calibration a host runs, run inside a quarter-core quota, measures a quarter of what it
measures inside a one-core quota; a process past its group's memory limit is killed by the
kernel, one within it is not. Skipped, saying why, where the kernel cannot (no root, no
cgroup controllers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster.limits import Group, Limits, unavailable

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no cgroup limits: {WHY_NOT}")
CALIBRATE = (
    "import json; from libs.devices.calibration import measure;"
    "c = measure(size=256, sustained_s=1.5);"
    "print(json.dumps([c.fp32_gflops, c.memory_bandwidth_gbps]))"
)


@pytest.fixture
def groups(uid: str) -> Iterator[list[Group]]:
    made: list[Group] = []
    yield made
    for group in made:
        group.remove()


def run_in(group: Group, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*group.prefix(), sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.alone  # compares two speeds: nothing may run beside it
def test_a_quarter_core_quota_calibrates_at_a_quarter_of_one_core(
    groups: list[Group], uid: str
) -> None:
    """Its FP32 speed and its memory bandwidth both (the prediction reads a stage's weights at
    the bandwidth its device calibrated)."""
    readings: dict[float, list[float]] = {}
    for cpus in (1.0, 0.25):
        group = Group(f"{uid}-{int(cpus * 100)}", Limits(cpus=cpus)).create()
        groups.append(group)
        for _ in range(2):  # the faster of two: a shared machine only ever slows a run
            done = run_in(group, CALIBRATE)
            assert done.returncode == 0, done.stderr
            got = json.loads(done.stdout)
            readings[cpus] = [max(a, b) for a, b in zip(readings.get(cpus, got), got, strict=True)]
    speed, bandwidth = (readings[0.25][i] / readings[1.0][i] for i in (0, 1))
    print(f"1 core {readings[1.0]}, 0.25 core {readings[0.25]}: {speed:.3f}, {bandwidth:.3f}")
    # A quarter, within the noise of one machine shared with others (0.192 was seen once with
    # single runs); half a core (0.5) or none (1.0) would be far outside it.
    assert 0.17 <= speed <= 0.33, readings
    # The copy's bandwidth too: timed from its first run (its destination's pages faulted
    # in) a quarter core read 0.14 of one core, faster of two.
    assert 0.16 <= bandwidth <= 0.35, readings


def test_a_process_past_its_memory_limit_is_killed_and_one_within_it_is_not(
    groups: list[Group], uid: str
) -> None:
    group = Group(f"{uid}-mem", Limits(memory_gb=0.25)).create()
    groups.append(group)
    touch = "b = bytearray({mb} * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held')"
    within = run_in(group, touch.format(mb=64))
    assert within.returncode == 0 and "held" in within.stdout, within.stderr
    past = run_in(group, touch.format(mb=512))
    assert past.returncode == -9 and "held" not in past.stdout, (past.returncode, past.stderr)
    assert group.pids() == []  # nothing left inside: the group goes with the fixture


def test_a_process_inside_a_group_reads_its_limit_and_what_the_group_uses(
    groups: list[Group], uid: str
) -> None:
    """What a held worker reports as its room: the limit, less what its group already uses
    (the worker itself), growing as it takes more."""
    group = Group(f"{uid}-room", Limits(memory_gb=0.5)).create()
    groups.append(group)
    read = (
        "import json; from libs.devices.cgroup_memory import memory_room_gb as room;"
        "before = room(); b = bytearray(96 * 2**20); b[::4096] = b'x' * len(b[::4096]);"
        "print(json.dumps([before, room()]))"
    )
    done = run_in(group, read)
    assert done.returncode == 0, done.stderr
    (limit, before), (again, after) = json.loads(done.stdout)
    assert limit == again == 0.5
    assert 0.0 < before < limit and after - before >= 0.09, (before, after)


def test_a_small_share_keeps_its_ratio_on_a_longer_period(groups: list[Group], uid: str) -> None:
    """A 5 ms period (a device idle between bursts still runs at its share), made longer where
    the kernel's shortest quota (1 ms) would not give the share asked for."""
    for cpus in (0.05, 0.5):
        group = Group(f"{uid}-{int(cpus * 100)}share", Limits(cpus=cpus)).create()
        groups.append(group)
        folder = group.procs_files()[0].parent
        if group.v2:
            quota, period = map(int, (folder / "cpu.max").read_text().split())
        else:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        assert quota / period == pytest.approx(cpus) and quota >= 1000
        assert period == (20_000 if cpus == 0.05 else 5_000)


def test_limits_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="cpus"):
        Limits(cpus=0)
    with pytest.raises(ValueError, match="memory_gb"):
        Limits(memory_gb=-1)
    with pytest.raises(ValueError, match="group name"):
        Group("../escape", Limits(cpus=1))


def test_a_command_that_cannot_enter_its_group_does_not_run(uid: str) -> None:
    group = Group(f"{uid}-half", Limits(cpus=0.5, memory_gb=0.5)).create()
    first = group.procs_files()[0].parent
    first.rmdir()  # one of its folders gone: the pid is written to the other one only
    try:
        done = run_in(group, "print('ran')")
        assert done.returncode != 0 and "ran" not in done.stdout  # not half held
    finally:
        group.remove()
