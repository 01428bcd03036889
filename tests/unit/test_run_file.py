"""A run file is trusted by its lock, not its pid: a file left by a killed cluster (its pid
still there, a zombie not yet reaped) is taken over by the next cluster, and `tessera devices`
reads the live one; while a cluster lives, the next one writes beside it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from libs.cli.devices import redis_url
from libs.cluster import runfile
from libs.cluster.up_options import choose_run_file
from tests.waiting import wait_until

#: A cluster in a child process: claims the run file, records its Redis, says so, lives on.
CLUSTER = """
import sys, time
from pathlib import Path
from libs.cluster import runfile
path, fd = runfile.claim(Path(sys.argv[1]))
runfile.write(fd, {"redis_url": sys.argv[2], "pid": __import__("os").getpid()})
print(path, flush=True)
time.sleep(600)
"""


def start_cluster(path: Path, redis: str) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", CLUSTER, str(path), redis],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def zombie(child: subprocess.Popen[str]) -> None:
    """Kill ``child`` and leave it unreaped: its pid still answers ``kill(pid, 0)``."""
    child.send_signal(signal.SIGKILL)

    def dead() -> bool:
        return Path(f"/proc/{child.pid}/stat").read_text().split(")")[1].split()[0] == "Z"

    asyncio.run(wait_until(dead, timeout_s=10))
    os.kill(child.pid, 0)  # the pid is still there


def test_a_run_file_left_by_a_killed_cluster_is_taken_over(tmp_path: Path) -> None:
    preferred = tmp_path / "cluster.json"
    killed, path = start_cluster(preferred, "redis://old:1/0")
    assert path == preferred
    zombie(killed)
    assert json.loads(preferred.read_text())["pid"] == killed.pid
    with pytest.raises(SystemExit, match="gone"):
        redis_url(None, preferred)  # not read as if that cluster still ran

    assert choose_run_file(preferred) == preferred  # the next cluster takes the file over
    live, path = start_cluster(preferred, "redis://new:2/0")
    try:
        assert path == preferred
        assert redis_url(None, preferred) == "redis://new:2/0"
    finally:
        live.kill()
        live.wait()
        killed.wait()


def test_a_live_cluster_keeps_its_run_file_and_the_next_writes_beside_it(tmp_path: Path) -> None:
    preferred = tmp_path / "cluster.json"
    first, _ = start_cluster(preferred, "redis://first:1/0")
    try:
        beside = choose_run_file(preferred)
        assert beside != preferred and beside.parent == preferred.parent
        path, fd = runfile.claim(preferred)  # the second cluster, here in this process
        assert path != preferred
        runfile.write(fd, {"redis_url": "redis://second:2/0"})
        assert redis_url(None, preferred) == "redis://first:1/0"
        assert redis_url(None, path) == "redis://second:2/0"
        runfile.release(path, fd)
        assert not path.exists()
    finally:
        first.kill()
        first.wait()
