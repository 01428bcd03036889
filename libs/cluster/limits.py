"""Limits the kernel enforces on an emulated device's processes: a CPU quota (cgroup CPU
bandwidth: ``cpus`` cores' worth of CPU time per period) and a memory limit, so that a device
of a fleet on one machine is as slow and as small as it says it is.

Both cgroup layouts: v1 (a hierarchy per controller, ``/sys/fs/cgroup/cpu`` and ``memory``:
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, ``memory.limit_in_bytes``) and v2 (one
hierarchy: ``cpu.max``, ``memory.max``). A group is made inside the cgroup this process is in,
so what it holds still counts against any limit above it. A process enters it before it runs
anything (``prefix``: a shell that writes its own pid, then executes the command), so every
process it starts is inside too.

Where the kernel cannot (no root, no such controller), ``unavailable()`` says why, and nothing
is limited: the caller says so and runs as before.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from libs.devices.cgroup_memory import ROOT, own_paths

#: The CPU quota's period: 5 ms. A group may run at full speed for its quota of each period;
#: over 100 ms (the kernel's default), a device busy a few milliseconds per token (one stage
#: of a split, waiting on the others) never used up its quota and ran at this machine's full
#: speed: splits measured up to 1.4 × faster at one stream, 1.8 × at eight, than over 5 ms, where
#: whole placements measured the same (bench/placement.py).
PERIOD_US = 5_000
#: The kernel's shortest quota (1 ms): a small share gets a longer period to keep to it.
MIN_QUOTA_US = 1_000
#: Name of every group made here (``tessera-<device>``); ``remove`` takes only these.
PREFIX = "tessera-"


class LimitsUnavailable(RuntimeError):
    """The kernel cannot enforce limits here; the message says why."""


@dataclass(frozen=True, slots=True)
class Limits:
    #: Cores' worth of CPU time (0.25: a quarter of one core), None: no quota.
    cpus: float | None = None
    memory_gb: float | None = None

    def __post_init__(self) -> None:
        if self.cpus is not None and not 0.01 <= self.cpus <= 1024:
            raise ValueError(f"cpus must be between 0.01 and 1024, not {self.cpus}")
        if self.memory_gb is not None and not self.memory_gb > 0.01:
            raise ValueError(f"memory_gb must be above 0.01, not {self.memory_gb}")


def layout(root: Path = ROOT) -> str:
    """ "v2" where the unified hierarchy holds the controllers, else "v1"."""
    return "v2" if (root / "cgroup.controllers").exists() else "v1"


def unavailable(root: Path = ROOT) -> str | None:
    """Why limits cannot be enforced here, or None when they can."""
    if os.geteuid() != 0:
        return "cgroup limits need root (this process runs as another user)"
    if layout(root) == "v2":
        if not {"cpu", "memory"} <= set((root / "cgroup.controllers").read_text().split()):
            return "the cgroup v2 hierarchy has no cpu and memory controllers"
        return None
    missing = [c for c in ("cpu", "memory") if not (root / c / "cgroup.procs").exists()]
    if missing:
        return f"no cgroup v1 {' and '.join(missing)} controller mounted under {root}"
    return None


class Group:
    """One device's cgroup (in each controller it limits), made by ``create``."""

    def __init__(self, name: str, limits: Limits, root: Path = ROOT) -> None:
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a group name is letters, digits, - and _: {name!r}")
        self.name, self.limits, self.root = PREFIX + name, limits, root
        self.v2 = layout(root) == "v2"
        own = own_paths()
        if self.v2:
            self.dirs = {"": root / own.get("", "/").lstrip("/") / self.name}
        else:
            self.dirs = {
                c: root / c / own.get(c, "/").lstrip("/") / self.name for c in self._controllers()
            }

    def _controllers(self) -> list[str]:
        return [
            c
            for c, wanted in (("cpu", self.limits.cpus), ("memory", self.limits.memory_gb))
            if wanted is not None
        ]

    def create(self) -> Group:
        """Make the group with its limits (again, if a run before left it); raises
        ``LimitsUnavailable`` where the kernel cannot."""
        reason = unavailable(self.root)
        if reason:
            raise LimitsUnavailable(reason)
        period, quota = self.period_and_quota()
        memory = None if self.limits.memory_gb is None else int(self.limits.memory_gb * 1024**3)
        try:
            for folder in self.dirs.values():
                folder.mkdir(exist_ok=True)
            if self.v2:
                folder = self.dirs[""]
                self._enable_v2(folder.parent)
                if quota is not None:
                    (folder / "cpu.max").write_text(f"{quota} {period}")
                if memory is not None:
                    (folder / "memory.max").write_text(str(memory))
                    (folder / "memory.swap.max").write_text("0")
            else:
                if quota is not None:
                    (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(period))
                    (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
                if memory is not None:
                    folder = self.dirs["memory"]
                    (folder / "memory.limit_in_bytes").write_text(str(memory))
                    if (folder / "memory.memsw.limit_in_bytes").exists():  # no swap beyond it
                        (folder / "memory.memsw.limit_in_bytes").write_text(str(memory))
        except OSError as exc:
            raise LimitsUnavailable(f"cannot set up the cgroup {self.name}: {exc}") from exc
        return self

    def period_and_quota(self) -> tuple[int, int | None]:
        """The CPU period and quota (µs) of ``cpus``: ``PERIOD_US``, longer where the quota
        would be under the kernel's shortest; no quota without ``cpus``."""
        cpus = self.limits.cpus
        if cpus is None:
            return PERIOD_US, None
        period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))
        return period, round(cpus * period)

    @staticmethod
    def _enable_v2(parent: Path) -> None:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        for controller in {"cpu", "memory"} - enabled:
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")

    def procs_files(self) -> list[Path]:
        return [folder / "cgroup.procs" for folder in self.dirs.values()]

    def prefix(self) -> list[str]:
        """A command prefix that enters the group, then runs the command: ``[*prefix, *argv]``."""
        # every write must succeed, or the command does not run (half held is not held)
        writes = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in self.procs_files())
        return ["sh", "-c", f'{writes} && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            if procs.exists():
                found |= {int(p) for p in procs.read_text().split()}
        return sorted(found)

    def remove(self) -> None:
        """Remove the group once no process is left in it (a no-op where it is gone)."""
        for folder in self.dirs.values():
            if folder.name.startswith(PREFIX) and folder.exists():
                try:
                    folder.rmdir()
                except OSError as exc:
                    raise RuntimeError(f"cgroup {folder} still holds {self.pids()}") from exc
