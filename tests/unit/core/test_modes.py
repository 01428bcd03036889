"""Automatic mode switching: the thresholds, hysteresis, and manual override."""

from __future__ import annotations

import pytest

from libs.contracts import Mode
from libs.core.modes import ModeSwitcher


def primed(**kw: float) -> ModeSwitcher:
    switcher = ModeSwitcher(dwell_s=10.0, **kw)
    assert switcher.observe(0.0, throughput=100.0, efficiency=10.0) is None
    return switcher


@pytest.mark.parametrize(
    ("throughput", "efficiency", "mode"),
    [
        (90.0, 10.0, Mode.PERFORMANCE),  # −10 % throughput
        (91.0, 10.0, Mode.BALANCED),  # −9 %: no switch
        (100.0, 8.5, Mode.ENERGY),  # −15 % efficiency
        (100.0, 8.6, Mode.BALANCED),  # −14 %: no switch
        (89.0, 8.0, Mode.PERFORMANCE),  # both: throughput wins
    ],
)
def test_switch_thresholds(throughput: float, efficiency: float, mode: Mode) -> None:
    switcher = primed()
    change = switcher.observe(20.0, throughput, efficiency)
    assert switcher.mode == mode
    assert (change is not None) is (mode != Mode.BALANCED)
    if change is not None:
        assert change.previous == Mode.BALANCED and not change.manual
        assert "dropped" in change.reason


def test_no_flapping_within_dwell_and_no_return_until_recovered() -> None:
    switcher = primed()
    assert switcher.observe(20.0, 100.0, 8.0) is not None  # → energy
    assert switcher.observe(25.0, 100.0, 10.0) is None  # recovered, but within dwell
    assert switcher.mode == Mode.ENERGY
    assert switcher.observe(31.0, 100.0, 9.0) is None  # −10 %: not within half of 15 %
    assert switcher.mode == Mode.ENERGY
    back = switcher.observe(32.0, 100.0, 9.5)  # −5 % ≤ 7.5 %: recovered
    assert back is not None and back.mode == Mode.BALANCED


def test_a_flapping_signal_switches_once_per_dwell() -> None:
    switcher = primed()
    changes = [switcher.observe(10.0 + t, 100.0, 8.4 if t % 2 else 10.0) for t in range(10)]
    assert sum(c is not None for c in changes) == 1


def test_baseline_follows_healthy_growth_only() -> None:
    switcher = primed()
    for t in range(50):
        switcher.observe(t + 1.0, 200.0, 20.0)
    assert switcher.baseline_throughput == pytest.approx(200.0, rel=0.01)
    assert switcher.observe(100.0, 185.0, 20.0) is None  # −7.5 % of the new baseline
    assert switcher.observe(101.0, 179.0, 20.0) is not None  # −10.5 %


def test_manual_override_wins_until_cleared() -> None:
    switcher = primed()
    change = switcher.override(Mode.PERFORMANCE, 5.0)
    assert change is not None and change.manual
    assert switcher.observe(100.0, 100.0, 5.0) is None
    assert switcher.mode == Mode.PERFORMANCE
    switcher.override(None, 110.0)
    assert switcher.observe(200.0, 100.0, 5.0) is not None
