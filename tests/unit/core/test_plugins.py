"""Filters and scores of the DWPS pipeline, with their edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from libs.contracts import DeviceClass, Mode
from libs.contracts.profiles import load_profile
from libs.core.dwps import Dwps
from libs.core.energy import dvfs_hint
from libs.core.fleet_state import FleetState
from libs.core.model import Device
from libs.core.pipeline import Pipeline
from libs.core.profiles import BUILTIN_PROFILES
from tests.builders import make_device, make_task, mixed_fleet

RNG = np.random.default_rng(0)


def verdicts(devices: list, task) -> dict:  # type: ignore[no-untyped-def]
    pipeline = Pipeline(BUILTIN_PROFILES[Mode.BALANCED])
    pipeline.prepare(FleetState(devices))
    return {v.device_id: v for v in pipeline.explain(task)}


@pytest.mark.parametrize(
    ("device", "task", "reason"),
    [
        (make_device("w", DeviceClass.WATCH), make_task(memory_gb=2.0), "memory"),
        (make_device("p", DeviceClass.PHONE, power_now_w=11.5), make_task(intensity=0.5), "power"),
        (make_device("l", temperature_c=80.0), make_task(intensity=0.5), "thermal"),
        (make_device("x", failed=True), make_task(), "failed"),
        (make_device("b", DeviceClass.PHONE, battery_percent=4.0), make_task(), "battery"),
        (make_device("ok"), make_task(), None),
    ],
)
def test_each_filter_rejects_with_its_reason(device, task, reason) -> None:  # type: ignore[no-untyped-def]
    verdict = verdicts([device], task)[device.device_id]
    assert verdict.reason == reason
    assert verdict.feasible is (reason is None)


def test_a_watch_never_receives_a_task_it_cannot_hold() -> None:
    policy = Dwps(BUILTIN_PROFILES[Mode.ENERGY])  # energy mode likes the watch best
    fleet = FleetState([make_device("watch", DeviceClass.WATCH)])
    small, big = make_task("small", memory_gb=0.1), make_task("big", memory_gb=1.6)
    placed = policy.place(fleet, [small, big], 0.0, RNG)
    assert placed[0].device_id == "watch"
    assert placed[1].device_id is None
    assert placed[1].reason == "no device fits: memory (1)"


def test_a_device_at_19_percent_battery_gets_proportionally_less() -> None:
    full = make_device("full", DeviceClass.PHONE, battery_percent=80.0)
    low = make_device("low", DeviceClass.PHONE, battery_percent=19.0)
    v = verdicts([full, low], make_task())
    assert v["low"].score == pytest.approx(v["full"].score * 0.95)
    plugged = make_device("plugged", DeviceClass.PHONE, battery_percent=19.0, plugged=True)
    assert verdicts([plugged], make_task())["plugged"].score == pytest.approx(v["full"].score)


def test_heat_backs_off_before_the_limit_and_filters_past_it() -> None:
    cool = verdicts([make_device("d", temperature_c=40.0)], make_task(intensity=0.1))["d"]
    warm = verdicts([make_device("d", temperature_c=80.0)], make_task(intensity=0.1))["d"]
    hot = verdicts([make_device("d", temperature_c=84.0)], make_task(intensity=0.1))["d"]
    assert cool.score > warm.score > 0
    assert hot.reason == "thermal"  # 84 + 20 × 0.1 = 86 °C > 85 °C


def test_desktop_limit_is_95_degrees() -> None:
    task = make_task(intensity=0.2)  # ΔT 25 × 0.2 = +5 °C
    ws = verdicts([make_device("ws", DeviceClass.WORKSTATION, temperature_c=89.0)], task)["ws"]
    assert ws.feasible
    ws = verdicts([make_device("ws", DeviceClass.WORKSTATION, temperature_c=90.0)], task)["ws"]
    assert ws.reason == "thermal"


def test_match_prefers_the_best_fit_when_the_devices_finish_alike() -> None:
    # The same speed and no queue anywhere: the completion term ties, the match decides.
    fleet = [
        make_device(d.device_id, d.device_class, speed=1.0, memory_free_gb=1.0)
        for d in mixed_fleet()
    ]
    efficient_work = make_task(demand=(0.1, 0.1, 0.95, 0.1, 0.2), memory_gb=0.1)
    compute_work = make_task(demand=(0.95, 0.5, 0.05, 0.3, 0.3), memory_gb=0.1)
    policy = Dwps()
    assert policy.place(FleetState(fleet), [efficient_work], 0, RNG)[0].device_id in {
        "watch",
        "phone",
    }
    assert policy.place(FleetState(fleet), [compute_work], 0, RNG)[0].device_id == "workstation"


def test_balanced_does_not_trade_time_for_fit() -> None:
    """A fast busy device against a slow idle one: the task goes where it finishes first."""
    efficient_work = make_task(demand=(0.1, 0.1, 0.95, 0.1, 0.2), work=10.0)
    slow_idle = make_device("slow-idle", DeviceClass.PHONE, speed=1.0)
    fast_busy = make_device("fast-busy", DeviceClass.WORKSTATION, speed=10.0, backlog_s=5.0)
    # slow: 0 s wait + 10 s; fast: 5 s wait + 1 s.
    assert Dwps().place(FleetState([slow_idle, fast_busy]), [efficient_work], 0, RNG)[
        0
    ].device_id == ("fast-busy")
    fast_busier = make_device("fast-busy", DeviceClass.WORKSTATION, speed=10.0, backlog_s=12.0)
    # slow: 10 s; fast: 12 s + 1 s.
    assert Dwps().place(FleetState([slow_idle, fast_busier]), [efficient_work], 0, RNG)[
        0
    ].device_id == ("slow-idle")


def test_urgent_tasks_of_one_cycle_do_not_pile_onto_one_device() -> None:
    fleet = FleetState([make_device(f"l{i}", slots=2) for i in range(4)])
    tasks = [make_task(f"u{i}", urgency=1.0, intensity=0.05) for i in range(8)]
    placed = Dwps().place(fleet, tasks, 0, RNG)
    per_device = {d: sum(p.device_id == d for p in placed) for d in fleet.ids}
    assert per_device == {"l0": 2, "l1": 2, "l2": 2, "l3": 2}


def test_urgent_tasks_choose_first() -> None:
    fleet = FleetState([make_device("only", slots=1, power_max_w=8.0, power_idle_w=5.0)])
    calm = make_task("calm", urgency=0.1, intensity=0.6)
    urgent = make_task("urgent", urgency=0.9, intensity=0.6)
    placed = Dwps().place(fleet, [calm, urgent], 0, RNG)
    assert [p.placed for p in placed] == [False, True]  # one fits the power budget


@pytest.mark.parametrize(
    ("load", "urgent", "temperature", "scale"),
    [
        (0.1, False, 40.0, 0.6),
        (0.5, False, 40.0, 0.8),
        (0.9, False, 40.0, 1.0),
        (0.1, True, 40.0, 1.0),
        (0.9, True, 82.0, 0.5),
    ],
)
def test_dvfs_hints(load: float, urgent: bool, temperature: float, scale: float) -> None:
    assert dvfs_hint(load, urgent, temperature, 85.0).frequency_scale == scale


def test_profiles_are_configuration_and_validated() -> None:
    data = BUILTIN_PROFILES[Mode.ENERGY].model_dump()
    data["name"] = "custom"
    data["scores"] = {"device_match": 1.0}
    custom = load_profile(data)
    assert Dwps(custom).profile.scores == {"device_match": 1.0}
    data["dimensions"]["compute"] = 0.9
    with pytest.raises(ValueError, match="sum to 1"):
        load_profile(data)
    data = BUILTIN_PROFILES[Mode.ENERGY].model_dump() | {"filters": ("memory", "teleport")}
    with pytest.raises(KeyError, match="teleport"):
        Pipeline(load_profile(data))


def test_completion_counts_a_requests_prefill_decode_and_the_wait_it_adds() -> None:
    fleet = FleetState(
        [
            make_device("a", slots=2, prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0),
            make_device("b", slots=1, speed=2.0),  # token rates unknown: work / speed
        ]
    )
    request = make_task(work=8.0, prompt_tokens=500, output_tokens=20)
    assert fleet.completion_s(request).tolist() == [0.5 + 2.0, 4.0]
    fleet.assign(0, request)  # one of a's two slots: no wait yet
    assert fleet.completion_s(request).tolist() == [2.5, 4.0]
    fleet.assign(0, request)  # its last slot: the next request waits about 2.5 s ÷ 2
    assert fleet.completion_s(request).tolist() == [1.25 + 2.5, 4.0]
    assert Dwps().place(fleet, [request], 0, RNG)[0].device_id == "a"  # 3.75 s < 4 s
    assert Dwps().place(fleet, [request], 0, RNG)[0].device_id == "b"  # a: 5 s now


def test_energy_mode_keeps_work_on_awake_devices_within_the_slack() -> None:
    energy = Dwps(BUILTIN_PROFILES[Mode.ENERGY])
    task = make_task(work=10.0, memory_gb=0.1)
    power = dict(power_idle_w=40.0, power_max_w=160.0, power_now_w=60.0, slots=4)
    asleep = make_device("asleep", DeviceClass.WORKSTATION, speed=2.0, idle_s=600.0, **power)

    def awake(speed: float) -> Device:
        return make_device("awake", DeviceClass.WORKSTATION, speed=speed, load=0.25, **power)

    # Both take 5 s. Awake and busy: its dynamic share, 5 s × 120 W / 4 slots = 150 J.
    # Asleep: the same 150 J + its idle power for 5 s and the 30 s sleep window = 1550 J.
    fleet = FleetState([awake(2.0), asleep])
    assert fleet.marginal_j(task).tolist() == [150.0, 150.0 + 40.0 * 35.0]
    assert energy.place(fleet, [task], 0, RNG)[0].device_id == "awake"
    # An awake device that would take 10 s against 5 s is past the 1.5× slack: the
    # sleeping one is woken.
    assert energy.place(FleetState([awake(1.0), asleep]), [task], 0, RNG)[0].device_id == ("asleep")
    # Under energy mode's power policy a woken device sleeps again 1.1 s after its work, not
    # 30 s: 150 J + 40 W × (5 s + 1/0.9 s).
    short = fleet.marginal_j(task, BUILTIN_PROFILES[Mode.ENERGY].sleep_after_s).tolist()
    assert short == pytest.approx([150.0, 150.0 + 40.0 * (5.0 + 1 / 0.9)])
