"""Emulated devices: class ranges, and power, heat, battery and faults reacting to work."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from libs.contracts import DeviceClass, Mode
from libs.core.energy import BREAK_EVEN_SLEEP_S, SLEEP_AFTER_S, SLEEP_SHARE, WAKE_S
from libs.core.profiles import BUILTIN_PROFILES
from libs.devices.classes import CLASS_PROFILES
from libs.devices.emulated import AMBIENT_C, IDLE_RISE_C, EmulatedDevice, Fault, FaultKind
from libs.devices.fleetfile import build, device_ids, load_fleet, mixed

RNG = np.random.default_rng(0)


def device(cls: DeviceClass = DeviceClass.PHONE, seed: int = 0) -> EmulatedDevice:
    return EmulatedDevice.draw("d", cls, np.random.default_rng(seed))


@pytest.mark.parametrize("cls", list(DeviceClass))
def test_drawn_devices_stay_in_their_class_ranges(cls: DeviceClass) -> None:
    profile = CLASS_PROFILES[cls]
    for seed in range(20):
        caps = device(cls, seed).capabilities
        assert profile.typical_power_w[0] <= caps.typical_power_w <= profile.typical_power_w[1]
        assert profile.memory_gb[0] - 0.05 <= caps.memory_total_gb <= profile.memory_gb[1] + 0.05
        assert caps.memory_type in profile.memory_types
        assert caps.has_battery is profile.has_battery


def test_design_ranges_for_the_seed_classes() -> None:
    assert CLASS_PROFILES[DeviceClass.PHONE].typical_power_w == (5, 15)
    assert CLASS_PROFILES[DeviceClass.LAPTOP].memory_gb == (8, 32)
    assert CLASS_PROFILES[DeviceClass.WATCH].typical_power_w[1] < 2
    assert CLASS_PROFILES[DeviceClass.WORKSTATION].typical_power_w == (65, 300)


def test_work_raises_power_and_heat_and_dvfs_lowers_power() -> None:
    d = device(DeviceClass.LAPTOP)
    idle_power = d.power_w
    d.assign("job", 1.0)
    assert d.power_w == pytest.approx(d.capabilities.max_power_w)
    d.frequency_scale = 0.5
    assert idle_power < d.power_w < d.capabilities.max_power_w
    d.frequency_scale = 1.0
    for t in range(600):
        d.step(1.0, float(t))
    steady = AMBIENT_C + IDLE_RISE_C + d.capabilities.delta_t_c
    assert d.temperature_c == pytest.approx(steady, abs=0.5)
    d.unassign("job")
    for t in range(600, 1200):
        d.step(1.0, float(t))
    assert d.temperature_c == pytest.approx(AMBIENT_C + IDLE_RISE_C, abs=0.5)


def test_dvfs_energy_per_token_falls_with_the_clock() -> None:
    """A fully busy device: dynamic power ∝ f³ while its rate ∝ f, so the dynamic joules
    of a token fall as f² (0.5 clock: a quarter)."""
    d = device(DeviceClass.WORKSTATION)
    d.assign("job", 1.0)
    per_token = {}
    for f in (1.0, 0.8, 0.5):
        d.frequency_scale = f
        per_token[f] = (d.power_w - d.idle_power_w) / (d.tokens_per_s or 1.0)
    assert per_token[1.0] > per_token[0.8] > per_token[0.5]
    assert per_token[0.5] == pytest.approx(per_token[1.0] / 4)


def test_a_device_without_work_sleeps_after_the_window() -> None:
    d = device(DeviceClass.WORKSTATION)
    idle = d.idle_power_w
    d.step(SLEEP_AFTER_S / 2, 1.0)
    assert not d.asleep and d.power_w == pytest.approx(idle)
    d.step(SLEEP_AFTER_S, 2.0)  # half awake at idle power, half asleep
    assert d.asleep and d.power_w == pytest.approx(idle * SLEEP_SHARE)
    expected = idle * SLEEP_AFTER_S + idle * SLEEP_SHARE * SLEEP_AFTER_S / 2
    assert d.energy_j == pytest.approx(expected)
    d.assign("job", 0.5)  # work wakes it
    assert not d.asleep and d.power_w > idle
    d.step(1.0, 3.0)
    d.unassign("job")
    d.step(1.0, 4.0)
    assert not d.asleep  # the window starts again


def test_battery_drains_unplugged_and_charges_plugged() -> None:
    d = device(DeviceClass.PHONE)
    d.plugged, d.battery_percent = False, 50.0
    d.assign("job", 1.0)
    d.step(600.0, 600.0)
    expected = 50.0 - d.capabilities.max_power_w * 600 / 3600 / d.battery_wh * 100
    assert d.battery_percent == pytest.approx(expected)
    d.plugged = True
    before = d.battery_percent
    d.step(60.0, 660.0)
    assert d.battery_percent > before


def test_scripted_faults() -> None:
    d = device(DeviceClass.PHONE)
    d.faults = (
        Fault(FaultKind.DROP_OUT, at_s=10, duration_s=5),
        Fault(FaultKind.OVERHEAT, at_s=0, duration_s=1000, amount=60.0),
        Fault(FaultKind.BATTERY_SAG, at_s=0, amount=10.0),
    )
    assert d.reporting(9.0) and not d.reporting(12.0) and d.reporting(15.0)
    for t in range(300):
        d.step(1.0, float(t))
    assert d.temperature_c > d.capabilities.thermal_limit_c
    assert d.battery_percent is not None and d.battery_percent <= 10.0


def test_samples_are_valid_contracts() -> None:
    for cls in DeviceClass:
        sample = device(cls).sample(1, 1_700_000_000.0, RNG)
        assert sample.memory_available_gb <= sample.memory_total_gb
        assert (sample.battery_percent is None) is (
            cls not in (DeviceClass.PHONE, DeviceClass.LAPTOP, DeviceClass.WATCH)
        )


def test_fleet_files_are_validated_and_deterministic() -> None:
    spec = load_fleet(
        {
            "seed": 3,
            "prefix": "home",
            "devices": {"phone": 2, "watch": 1},
            "faults": [{"device": "home-phone-1", "kind": "drop_out", "at_s": 5}],
        }
    )
    assert device_ids(spec) == ["home-phone-0", "home-phone-1", "home-watch-0"]
    first, second = build(spec), build(spec)
    assert [d.capabilities for d in first] == [d.capabilities for d in second]
    assert first[1].faults[0].kind == FaultKind.DROP_OUT
    with pytest.raises(ValidationError, match="unknown devices"):
        load_fleet(
            {"devices": {"phone": 1}, "faults": [{"device": "x", "kind": "drop_out", "at_s": 1}]}
        )
    with pytest.raises(ValidationError, match="toaster"):
        load_fleet({"devices": {"toaster": 1}})
    assert sum(mixed(10).devices.values()) == 10


def test_energy_modes_power_policy_sleeps_at_the_break_even_time_and_saves_on_a_gap() -> None:
    """Waking costs WAKE_S of idle power and a second asleep saves 0.9 of it: 1/0.9 s."""
    assert pytest.approx(WAKE_S / (1 - SLEEP_SHARE)) == BREAK_EVEN_SLEEP_S
    assert BUILTIN_PROFILES[Mode.ENERGY].sleep_after_s == BREAK_EVEN_SLEEP_S
    assert BUILTIN_PROFILES[Mode.PERFORMANCE].sleep_after_s == SLEEP_AFTER_S
    gap_s = 10.0  # no work for 10 s between two requests
    used = {}
    for sleep_after_s in (SLEEP_AFTER_S, BREAK_EVEN_SLEEP_S):
        d = device(DeviceClass.WORKSTATION)
        d.sleep_after_s = sleep_after_s
        d.step(gap_s, 1.0)
        # the next request wakes a sleeping device: WAKE_S more at idle power
        used[sleep_after_s] = d.energy_j + (d.idle_power_w * WAKE_S if d.asleep else 0.0)
    idle = device(DeviceClass.WORKSTATION).idle_power_w
    assert used[SLEEP_AFTER_S] == pytest.approx(idle * gap_s)  # awake all along
    expected = idle * (BREAK_EVEN_SLEEP_S + SLEEP_SHARE * (gap_s - BREAK_EVEN_SLEEP_S) + WAKE_S)
    assert used[BREAK_EVEN_SLEEP_S] == pytest.approx(expected)  # 3.0 of 10 s at idle power
    assert used[BREAK_EVEN_SLEEP_S] < 0.35 * used[SLEEP_AFTER_S]
