"""The workers of ``tessera up --fleet FILE`` that the kernel holds to their device's size
(the fleet file's ``workers``, ``libs/devices/fleetfile.py``): each runs inside a cgroup of its
own (``libs/cluster/limits.py``) with its CPU quota and memory limit, reports its class, the
memory it may use, and the speed it measures inside its quota (``TESSERA_WORKER_CPUS``: the
worker calibrates itself there instead of reading the host's cached calibration).

Where the kernel cannot enforce limits (no root, no cgroup controllers) ``start`` says why and
the workers run unlimited, with the memory the file gives them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import yaml

from libs.cluster.limits import Group, Limits, LimitsUnavailable
from libs.devices.fleetfile import WorkerSpec, load_fleet


class EnforcedFleet:
    def __init__(self, workers: tuple[WorkerSpec, ...], run_id: str) -> None:
        self.workers = {w.id: w for w in workers}
        self.groups = {
            w.id: Group(f"{run_id}-{w.id}", Limits(cpus=w.cpus, memory_gb=w.memory_gb))
            for w in workers
        }
        self.enforced = False

    @classmethod
    def read(cls, path: Path | None, run_id: str) -> EnforcedFleet | None:
        """The fleet file's workers, or None when it lists none (or there is no file)."""
        if path is None:
            return None
        spec = load_fleet(yaml.safe_load(path.read_text()) or {})
        return cls(spec.workers, run_id) if spec.workers else None

    def names(self, engine: str) -> list[tuple[str, str]]:
        return [(name, engine) for name in self.workers]

    def env(self, name: str) -> dict[str, str]:
        worker = self.workers[name]
        threads = str(max(1, round(worker.cpus)))  # the cores its quota gives, at least one
        env = {
            "TESSERA_WORKER_DEVICE_CLASS": worker.device_class.value,
            "TESSERA_WORKER_MEMORY_GB": str(worker.memory_gb),
            "TESSERA_WORKER_LLAMA_THREADS": threads,
            "OMP_NUM_THREADS": threads,
        }
        if self.enforced:
            env["TESSERA_WORKER_CPUS"] = str(worker.cpus)
        return env

    def prefix(self, name: str) -> list[str]:
        return self.groups[name].prefix() if self.enforced and name in self.groups else []

    def start(self, say: Callable[[str], None]) -> None:
        """Make every worker's group; where the kernel cannot, say why and go on unlimited."""
        try:
            for group in self.groups.values():
                group.create()
        except LimitsUnavailable as exc:
            self.stop()
            say(f"fleet: limits not enforced ({exc}): its workers run unlimited")
            return
        self.enforced = True
        for name, worker in self.workers.items():
            say(
                f"fleet: {name} ({worker.device_class.value}) held to {worker.cpus:g} cores "
                f"and {worker.memory_gb:g} GB"
            )

    def stop(self) -> None:
        """Remove the groups (once their processes have stopped)."""
        for group in self.groups.values():
            with contextlib.suppress(RuntimeError):  # a process still inside: left behind
                group.remove()
