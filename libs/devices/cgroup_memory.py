"""The memory this process's cgroup holds it to, and what the group uses now: read from the
kernel's files (v1 ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``, v2 ``memory.max``
and ``memory.current``) of the group ``/proc/self/cgroup`` names. A worker held to a device's
size (``tessera up --fleet``, ``libs/cluster/limits.py``) reports the room its limit leaves it,
so that the placement counts the limit before a model is sent there. ``own_paths`` is also where
``libs/cluster/limits.py`` makes a device's groups (inside this process's own)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
#: v1 reports "no limit" as a huge number (a page-aligned 2^63 - 1).
UNLIMITED = 1 << 60


def own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller ("" for v2's single hierarchy)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _group(root: Path) -> Path | None:
    """This process's memory cgroup folder (v2's one group, else v1's memory controller)."""
    own = own_paths()
    if (root / "cgroup.controllers").exists():
        return root / own.get("", "/").lstrip("/")
    return root / "memory" / own["memory"].lstrip("/") if "memory" in own else None


def memory_room_gb(root: Path = ROOT) -> tuple[float, float] | None:
    """(limit, used) in GB of this process's memory cgroup; None where it has no limit (or
    no such group can be read)."""
    group = _group(root)
    if group is None:
        return None
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    if not (group / names[0]).exists():
        names = ("memory.max", "memory.current")
    try:
        limit_text, used_text = ((group / n).read_text().strip() for n in names)
    except OSError:
        return None
    if limit_text == "max" or int(limit_text) >= UNLIMITED:
        return None
    return int(limit_text) / 1024**3, int(used_text) / 1024**3
