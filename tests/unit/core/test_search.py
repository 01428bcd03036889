"""The block search picks exactly what scoring every device picks (``libs/core/search.py``).

The reference is the same pipeline on a fleet without blocks (``block_size=None``): every
device filtered and scored, ``argmax`` over the feasible ones. The fleets are random and
awkward on purpose: failed devices, low batteries, hot devices, token rates on some devices,
identical devices (ties go to the lowest index), tasks nothing can take.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from libs.contracts import DeviceClass, Mode
from libs.contracts.profiles import Profile
from libs.core import energy
from libs.core.capability import total_score
from libs.core.dwps import Dwps
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Placement, Task
from libs.core.profiles import BUILTIN_PROFILES

CLASSES = list(DeviceClass)
#: Balanced mode's scores with energy mode's filters (``completion_slack`` among them).
SLACK = BUILTIN_PROFILES[Mode.BALANCED].model_copy(
    update={"name": "slack", "filters": BUILTIN_PROFILES[Mode.ENERGY].filters}
)


def random_fleet(n: int, rng: np.random.Generator) -> list[Device]:
    devices: list[Device] = []
    for i in range(n):
        if i % 7 == 6:  # an identical twin of the device before it
            devices.append(replace(devices[-1], device_id=f"d{i}"))
            continue
        memory = float(rng.uniform(1, 64))
        power_max = float(rng.uniform(2, 400))
        on_battery = bool(rng.random() < 0.3)
        tokens = bool(rng.random() < 0.3)
        devices.append(
            Device(
                device_id=f"d{i}",
                device_class=CLASSES[i % len(CLASSES)],
                capability=tuple(rng.uniform(0.0, 1.0, 5).tolist()),
                memory_total_gb=memory,
                memory_free_gb=memory * float(rng.uniform(0.0, 1.0)),
                power_max_w=power_max,
                power_now_w=power_max * float(rng.uniform(0.05, 1.0)),
                power_idle_w=power_max * 0.05,
                temperature_c=float(rng.uniform(25, 90)),
                thermal_limit_c=85.0 if i % 2 else 95.0,
                delta_t_c=float(rng.uniform(5, 30)),
                speed=float(rng.choice([1.0, 2.0, 4.0, rng.uniform(0.5, 50)])),
                slots=int(rng.integers(1, 8)),
                load=float(rng.choice([0.0, 0.5, 1.5])),
                battery_percent=float(rng.uniform(1, 100)) if on_battery else None,
                plugged=not on_battery,
                failed=bool(rng.random() < 0.05),
                prefill_tokens_per_s=float(rng.uniform(50, 500)) if tokens else 0.0,
                decode_tokens_per_s=float(rng.uniform(5, 50)) if tokens else 0.0,
                backlog_s=float(rng.uniform(0, 2)) if rng.random() < 0.2 else None,
            )
        )
    return devices


def random_tasks(n: int, rng: np.random.Generator) -> list[Task]:
    return [
        Task(
            f"t{i}",
            demand=tuple(rng.uniform(0.01, 1.0, 5).tolist()),
            urgency=float(rng.random()),
            complexity=float(rng.random()),
            memory_gb=float(rng.choice([0.0, rng.uniform(0.01, 4.0), 80.0])),
            intensity=float(rng.uniform(0.001, 0.3)),
            work=float(rng.uniform(0.1, 3.0)),
            prompt_tokens=int(rng.integers(0, 400)) if i % 3 == 0 else 0,
            output_tokens=int(rng.integers(1, 200)) if i % 3 == 0 else 0,
        )
        for i in range(n)
    ]


def place_all(
    profile: Profile, devices: list[Device], tasks: list[Task], block_size: int | None
) -> list[Placement]:
    fleet = FleetState(devices, block_size=block_size)
    policy = Dwps(profile)
    placements = []
    for start in range(0, len(tasks), 50):  # several cycles: blocks carry over between them
        placements += policy.place(fleet, tasks[start : start + 50], 0.0, np.random.default_rng(0))
    return placements


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "profile",
    [BUILTIN_PROFILES[Mode.BALANCED], BUILTIN_PROFILES[Mode.PERFORMANCE], SLACK],
    ids=["balanced", "performance", "slack"],
)
def test_the_block_search_picks_what_scoring_every_device_picks(
    seed: int, profile: Profile
) -> None:
    rng = np.random.default_rng(seed)
    devices, tasks = random_fleet(700, rng), random_tasks(300, rng)
    searched = place_all(profile, devices, tasks, block_size=16)
    reference = place_all(profile, devices, tasks, block_size=None)
    assert [(p.device_id, p.score) for p in searched] == [(p.device_id, p.score) for p in reference]
    placed = sum(p.placed for p in reference)
    assert 0 < placed < len(tasks)  # the fleets fill up: some tasks fit nowhere


def test_the_block_search_is_used_on_a_large_fleet() -> None:
    rng = np.random.default_rng(3)
    fleet = FleetState(random_fleet(600, rng), block_size=16)
    policy = Dwps()
    policy.place(fleet, random_tasks(1, rng), 0.0, rng)
    assert policy.pipeline.search is not None
    small = FleetState(random_fleet(10, rng), block_size=16)
    policy.place(small, random_tasks(1, rng), 0.0, rng)
    assert policy.pipeline.search is None


def test_ties_go_to_the_lowest_index_as_argmax_does() -> None:
    rng = np.random.default_rng(4)
    [one] = random_fleet(1, rng)
    one = replace(one, failed=False, battery_percent=None, plugged=True, memory_free_gb=1.0)
    twins = [replace(one, device_id=f"twin{i}", power_now_w=one.power_idle_w) for i in range(200)]
    task = Task("t", memory_gb=0.0, intensity=0.001)
    one = replace(one, temperature_c=25.0)
    twins = [replace(t, temperature_c=25.0) for t in twins]
    policy = Dwps()
    [placement] = policy.place(FleetState(twins, block_size=4), [task], 0.0, rng)
    assert policy.pipeline.search is not None
    assert placement.device_id == "twin0"


def test_the_choice_is_the_best_by_the_formula_computed_by_hand() -> None:
    """An independent check of what both paths compute: balanced mode's score, device by
    device in plain Python, for each task alone on a fresh fleet."""
    rng = np.random.default_rng(5)
    devices = [d for d in random_fleet(400, rng) if not d.failed]
    profile = BUILTIN_PROFILES[Mode.BALANCED]
    weights = profile.scores
    for task in random_tasks(40, rng):
        fleet = FleetState(devices, block_size=16)
        [placement] = Dwps(profile).place(fleet, [task], 0.0, rng)
        by_hand = hand_scores(devices, task, profile)
        if not by_hand:
            assert placement.device_id is None
            continue
        ranked = sorted(by_hand.values(), reverse=True)
        best = ranked[0]
        chosen = by_hand[placement.device_id]  # type: ignore[index]
        assert chosen == pytest.approx(best, abs=1e-9)
        assert placement.score == pytest.approx(
            best + profile.urgency * task.urgency + (profile.complexity * task.complexity), abs=1e-9
        )
        assert weights["completion"] > 0


def hand_scores(devices: list[Device], task: Task, profile: Profile) -> dict[str, float]:
    def service(d: Device) -> float:
        if task.output_tokens > 0 and d.prefill_tokens_per_s > 0 and d.decode_tokens_per_s > 0:
            return task.prompt_tokens / d.prefill_tokens_per_s + (
                task.output_tokens / d.decode_tokens_per_s
            )
        return task.work / d.speed

    def backlog(d: Device) -> float:
        if d.backlog_s is not None:
            return d.backlog_s
        return max(0.0, d.load * d.slots - d.slots + 1.0) / d.speed / d.slots

    finish = {d.device_id: backlog(d) + service(d) for d in devices}
    earliest = min(finish.values())
    norm = math.sqrt(sum(x * x for x in task.demand))
    scores = {}
    for d in devices:
        battery = (d.battery_percent or 100.0) / 100.0
        if (d.on_battery and battery < energy.BATTERY_FLOOR) or d.memory_free_gb < task.memory_gb:
            continue
        dynamic = max(d.power_max_w - d.power_idle_w, 1e-9)
        if max(d.power_max_w - d.power_now_w, 0.0) / dynamic - 0.01 < task.intensity:
            continue
        if (d.thermal_limit_c - d.temperature_c) / max(d.delta_t_c, 1e-9) <= task.intensity:
            continue
        cap_norm = math.sqrt(sum(x * x for x in d.capability))
        match = sum(c * x for c, x in zip(d.capability, task.demand, strict=True)) / (
            (cap_norm or 1.0) * norm
        )
        total = float(total_score(np.asarray(d.capability), profile.dimensions.as_tuple()))
        factor = min(1.0, battery / 0.2) if d.on_battery else 1.0
        factor *= min(1.0, max(0.0, (d.thermal_limit_c - d.temperature_c) / 10.0))
        ratio = max(earliest, 1e-12) / max(finish[d.device_id], 1e-12)
        weights = profile.scores
        scores[d.device_id] = factor * (
            weights["capability"] * total
            + weights["device_match"] * match
            + weights["completion"] * ratio
        )
    return scores
