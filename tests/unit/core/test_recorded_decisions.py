"""DWPS makes the decisions it made before the decision loop was sped up, value for value.

``recorded_decisions.json.gz`` holds, for fixed seeded runs, every placement's device and score
(the float's exact hex form) as the pipeline made them before its search was reworked for
speed. Changes that only make placement faster must leave every one of them as it is; a change
meant to alter decisions rewrites the file, in its own commit that says why:

    PYTHONPATH=. python -m tests.unit.core.test_recorded_decisions --write

The runs: the placement benchmark's fleet of 10,000 devices (``bench/scheduler.py``: uniform
random devices, tasks of unit work) in balanced and performance mode, placed in cycles of 500
on blocks of the fleet's default size (the search is exact: the size changes no decision);
and the block-search test's awkward fleet (failed devices, twins, low batteries, token
rates, tasks nothing can take) in every mode, on small blocks, energy mode scoring every
device.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from libs.contracts import Mode
from libs.contracts.profiles import Profile
from libs.core.blocks import BLOCK_SIZE
from libs.core.dwps import Dwps
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Task
from libs.core.profiles import BUILTIN_PROFILES
from libs.sim.random_fleets import random_fleet, random_tasks
from tests.unit.core import test_search

RECORDED = Path(__file__).with_name("recorded_decisions.json.gz")


def decisions(
    profile: Profile,
    devices: list[Device],
    tasks: list[Task],
    cycle: int,
    block_size: int | None,
) -> list[str]:
    """Each placement as ``"task device score"`` (score in hex; ``-`` for no device)."""
    fleet = FleetState(devices, block_size=block_size)
    policy = Dwps(profile)
    out = []
    for start in range(0, len(tasks), cycle):
        for p in policy.place(fleet, tasks[start : start + cycle], 0.0, np.random.default_rng(0)):
            out.append(f"{p.task_id} {p.device_id or '-'} {p.score.hex()}")
    return out


def bench_run(mode: Mode) -> Callable[[], list[str]]:
    def run() -> list[str]:
        rng = np.random.default_rng(0)
        devices = random_fleet(10_000, rng)
        tasks = random_tasks(2_000, rng)
        return decisions(BUILTIN_PROFILES[mode], devices, tasks, 500, block_size=BLOCK_SIZE)

    return run


def awkward_run(profile: Profile) -> Callable[[], list[str]]:
    def run() -> list[str]:
        rng = np.random.default_rng(11)
        devices = test_search.random_fleet(1_500, rng)
        tasks = test_search.random_tasks(400, rng)
        return decisions(profile, devices, tasks, 50, block_size=16)

    return run


RUNS: dict[str, Callable[[], list[str]]] = {
    "bench-balanced": bench_run(Mode.BALANCED),
    "bench-performance": bench_run(Mode.PERFORMANCE),
    "awkward-balanced": awkward_run(BUILTIN_PROFILES[Mode.BALANCED]),
    "awkward-performance": awkward_run(BUILTIN_PROFILES[Mode.PERFORMANCE]),
    "awkward-slack": awkward_run(test_search.SLACK),
    "awkward-energy": awkward_run(BUILTIN_PROFILES[Mode.ENERGY]),
}


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[str]]:
    with gzip.open(RECORDED, "rt") as f:
        return json.load(f)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(RUNS))
def test_dwps_makes_the_recorded_decisions(name: str, recorded: dict[str, list[str]]) -> None:
    made, expected = RUNS[name](), recorded[name]
    assert len(made) == len(expected)
    for i, (now, before) in enumerate(zip(made, expected, strict=True)):
        assert now == before, f"placement {i} of {name} differs"
    placed = sum(line.split()[1] != "-" for line in expected)
    assert placed > 0  # the runs place tasks (and the awkward ones leave some unplaced)


def write() -> None:
    data = {name: run() for name, run in RUNS.items()}
    with gzip.GzipFile(RECORDED, "wb", mtime=0) as f:
        f.write(json.dumps(data, indent=0).encode())


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.core.test_recorded_decisions --write")
    write()
