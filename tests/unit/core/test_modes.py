"""Automatic mode switching: the 10 % and 15 % thresholds on performance per unit of demand,
hysteresis, manual override, and an idle cluster that keeps its mode."""

from __future__ import annotations

import pytest

from libs.contracts import Mode
from libs.core.modes import ModeSwitcher

#: Busy slots of the observations below (requests being served), one load band.
BUSY = 4.0


def primed() -> ModeSwitcher:
    """A switcher whose baseline at ``BUSY`` slots is 100 tokens/s (25 per slot), 10 tokens/J:
    the first observation at a load only opens it, the second sets the baseline."""
    switcher = ModeSwitcher(dwell_s=10.0)
    assert switcher.observe(0.0, throughput=100.0, efficiency=10.0, busy=BUSY) is None
    assert switcher.observe(0.5, throughput=100.0, efficiency=10.0, busy=BUSY) is None
    assert switcher.baselines
    return switcher


@pytest.mark.parametrize(
    ("throughput", "efficiency", "mode"),
    [
        (90.0, 10.0, Mode.PERFORMANCE),  # −10 % tokens/s per busy slot
        (91.0, 10.0, Mode.BALANCED),  # −9 %: no switch
        (100.0, 8.5, Mode.ENERGY),  # −15 % efficiency
        (100.0, 8.6, Mode.BALANCED),  # −14 %: no switch
        (89.0, 8.0, Mode.PERFORMANCE),  # both: performance wins
    ],
)
def test_the_seeds_thresholds_at_the_same_demand(
    throughput: float, efficiency: float, mode: Mode
) -> None:
    switcher = primed()
    change = switcher.observe(20.0, throughput, efficiency, BUSY)
    assert switcher.mode == mode
    assert (change is not None) is (mode != Mode.BALANCED)
    if change is not None:
        assert change.previous == Mode.BALANCED and not change.manual
        assert "dropped" in change.reason


def test_an_idle_cluster_after_a_burst_keeps_its_mode() -> None:
    """The incident: 100 tokens/s in a burst, then nothing; the cluster's throughput fell
    100 % because demand did, not performance."""
    switcher = primed()
    changes = [switcher.observe(1.0 + t, 100.0, 10.0, BUSY) for t in range(30)]
    # The burst ends: the rate window still holds some tokens, then none; nothing is busy.
    changes += [switcher.observe(31.0, 40.0, 4.0, 0.0), switcher.observe(36.0, 0.0, 0.0, 0.0)]
    changes += [switcher.observe(36.0 + t, 0.0, 0.0, 0.0) for t in range(1, 61)]
    assert changes == [None] * len(changes)
    assert switcher.mode == Mode.BALANCED


def test_less_demand_at_the_same_performance_per_slot_keeps_the_mode() -> None:
    switcher = primed()
    # A quarter of the demand: a quarter of the tokens/s and, with idle power, less tokens/J.
    changes = [switcher.observe(20.0 + t, 25.0, 6.0, 1.0) for t in range(10)]
    assert changes == [None] * len(changes)
    assert switcher.mode == Mode.BALANCED


def test_a_real_fall_in_performance_per_slot_switches_after_a_change_of_load() -> None:
    switcher = primed()
    assert switcher.observe(20.0, 20.0, 10.0, 1.0) is None  # load fell: the window mixes loads
    assert switcher.observe(21.0, 20.0, 10.0, 1.0) is None  # the baseline at 1 slot
    assert switcher.observe(22.0, 18.0, 10.0, 1.0) is not None  # −10 % per slot
    assert switcher.mode == Mode.PERFORMANCE


def test_the_first_reading_after_a_change_of_load_is_not_taken_for_a_drop() -> None:
    switcher = primed()
    assert switcher.observe(30.0, 0.0, 0.0, 0.0) is None  # idle
    # Demand is back but the workers' rate window still holds mostly idle seconds.
    assert switcher.observe(35.0, 20.0, 2.0, BUSY) is None
    assert switcher.mode == Mode.BALANCED
    assert switcher.observe(40.0, 100.0, 10.0, BUSY) is None


def test_no_flapping_within_dwell_and_no_return_until_recovered() -> None:
    switcher = primed()
    assert switcher.observe(20.0, 100.0, 8.0, BUSY) is not None  # → energy
    assert switcher.observe(25.0, 100.0, 10.0, BUSY) is None  # recovered, but within dwell
    assert switcher.mode == Mode.ENERGY
    assert switcher.observe(31.0, 100.0, 9.0, BUSY) is None  # −10 %: not within half of 15 %
    assert switcher.mode == Mode.ENERGY
    back = switcher.observe(32.0, 100.0, 9.5, BUSY)  # −5 % ≤ 7.5 %: recovered
    assert back is not None and back.mode == Mode.BALANCED


def test_a_flapping_signal_switches_once_per_dwell() -> None:
    switcher = primed()
    changes = [switcher.observe(10.0 + t, 100.0, 8.4 if t % 2 else 10.0, BUSY) for t in range(10)]
    assert sum(c is not None for c in changes) == 1


def test_baseline_follows_healthy_growth_only() -> None:
    switcher = primed()
    for t in range(50):
        switcher.observe(t + 1.0, 200.0, 20.0, BUSY)
    [(per_slot, _)] = switcher.baselines.values()
    assert per_slot == pytest.approx(200.0 / BUSY, rel=0.01)
    assert switcher.observe(100.0, 185.0, 20.0, BUSY) is None  # −7.5 % of the new baseline
    assert switcher.observe(101.0, 179.0, 20.0, BUSY) is not None  # −10.5 %


def test_manual_override_wins_until_cleared() -> None:
    switcher = primed()
    change = switcher.override(Mode.PERFORMANCE, 5.0)
    assert change is not None and change.manual
    assert switcher.observe(100.0, 100.0, 5.0, BUSY) is None
    assert switcher.mode == Mode.PERFORMANCE
    switcher.override(None, 110.0)
    assert switcher.observe(200.0, 100.0, 5.0, BUSY) is not None
