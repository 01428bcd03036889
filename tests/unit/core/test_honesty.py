"""Claims checked against measurements: liars scaled to what they measure, honest devices not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.core.honesty import TOLERANCE, device_ratio, speed_scales


def test_the_ratio_is_the_median_of_the_measurements_over_the_claim() -> None:
    assert device_ratio([50.0, 500.0, 40.0], claimed_tflops=0.2) == pytest.approx(0.25)
    assert device_ratio([], claimed_tflops=0.2) is None
    assert device_ratio([0.0], claimed_tflops=0.2) is None  # nothing run yet
    assert device_ratio([50.0], claimed_tflops=0.0) is None


def test_a_device_claiming_ten_times_its_speed_is_scaled_to_a_tenth() -> None:
    scales = speed_scales({"a": 0.25, "b": 0.2, "c": 0.3, "liar": 0.025})
    assert scales["liar"] == pytest.approx(0.1)
    assert scales["a"] == scales["b"] == scales["c"] == 1.0


def test_one_device_alone_cannot_be_checked() -> None:
    assert speed_scales({"only": 0.001}) == {"only": 1.0}


def test_two_devices_the_slower_claim_is_judged_by_the_faster() -> None:
    assert speed_scales({"honest": 0.25, "liar": 0.025}) == {"honest": 1.0, "liar": 0.1}


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=4), st.floats(min_value=1e-6, max_value=10.0), max_size=12
    )
)
def test_scales_are_in_0_1_and_only_for_devices_far_below_the_reference(
    ratios: dict[str, float],
) -> None:
    scales = speed_scales(ratios)
    assert scales.keys() == ratios.keys()
    for device_id, scale in scales.items():
        assert 0.0 < scale <= 1.0
        if scale < 1.0:  # at least half the fleet measures TOLERANCE times better
            better = [r for r in ratios.values() if r > ratios[device_id] * TOLERANCE]
            assert len(better) >= len(ratios) // 2
