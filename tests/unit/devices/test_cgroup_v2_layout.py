"""The cgroup v2 half of a device's limits (``libs/cluster/limits.py``) and of the memory room a
held worker reads (``libs/devices/cgroup_memory.py``), on a v2 hierarchy laid out in a temp
folder: this machine's kernel binds the cpu and memory controllers to v1 (its cgroup2 mount
holds none), so v2 cannot be enforced here. What this checks is what Tessera writes and reads
there, file by file; that the kernel holds a device to it is checked on v1
(``tests/integration/test_limits.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libs.cluster.limits import Group, Limits, layout, unavailable
from libs.devices.cgroup_memory import memory_room_gb, own_paths

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="limits are made as root only")


def v2_root(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    """A v2 hierarchy's files at the group this process is in."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    own = tmp_path / own_paths().get("", "/").lstrip("/")
    own.mkdir(parents=True, exist_ok=True)
    (own / "cgroup.subtree_control").write_text("")
    return tmp_path


def test_a_v2_hierarchy_is_told_from_v1_and_needs_both_controllers(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    assert layout(root) == "v2" and unavailable(root) is None
    bare = v2_root(tmp_path / "bare", controllers="pids")
    assert unavailable(bare) == "the cgroup v2 hierarchy has no cpu and memory controllers"


def test_a_v2_group_gets_its_quota_memory_and_no_swap_and_is_entered_before_the_command(
    tmp_path: Path,
) -> None:
    root = v2_root(tmp_path)
    group = Group("laptop", Limits(cpus=0.25, memory_gb=1.5), root=root).create()
    [folder] = group.dirs.values()
    assert folder.parent == root / own_paths().get("", "/").lstrip("/")
    assert (folder / "cpu.max").read_text() == "1250 5000"  # a quarter of each 5 ms
    assert (folder / "memory.max").read_text() == str(int(1.5 * 1024**3))
    assert (folder / "memory.swap.max").read_text() == "0"
    # Its parent hands both controllers down (the kernel keeps each "+name" written).
    assert (folder.parent / "cgroup.subtree_control").read_text() in ("+cpu", "+memory")
    assert group.procs_files() == [folder / "cgroup.procs"]
    script = group.prefix()[2]
    assert script.startswith(f"echo $$ > {folder / 'cgroup.procs'} && exec")


def test_a_held_worker_reads_its_room_from_v2s_files(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    own = root / own_paths().get("", "/").lstrip("/")
    (own / "memory.max").write_text(f"{2 * 1024**3}\n")
    (own / "memory.current").write_text(f"{512 * 1024**2}\n")
    assert memory_room_gb(root) == (2.0, 0.5)
    (own / "memory.max").write_text("max\n")  # no limit
    assert memory_room_gb(root) is None
