"""The five dimensions: hand-computed values and properties (in [0, 1], monotone)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.contracts import MemoryType
from libs.core import capability as cap

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False)
fraction = st.floats(min_value=0.0, max_value=1.0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.001, 0.0), (0.005, 0.0), (200.0, 1.0), (1e9, 1.0), (math.sqrt(0.005 * 200.0), 0.5)],
)
def test_log_scale_hand_values(value: float, expected: float) -> None:
    assert cap.log_scale(value, 0.005, 200.0) == pytest.approx(expected)


def test_compute_index_mixes_by_model_type() -> None:
    # FP32 at the top of its range, INT8 and bandwidth at the bottom.
    assert cap.compute_index(200.0, 0.01, 5.0, "float") == pytest.approx(0.6)
    assert cap.compute_index(200.0, 0.01, 5.0, "quantised") == pytest.approx(0.2)
    assert cap.compute_index(0.005, 2000.0, 5.0, "quantised") == pytest.approx(0.6)


def test_memory_score_hand_values() -> None:
    assert cap.memory_score(2.0, 4.0, MemoryType.LPDDR5) == pytest.approx(0.5 * 0.85)
    assert cap.memory_score(8.0, 4.0, MemoryType.DDR4) == pytest.approx(0.55)
    assert cap.memory_score(-1.0, 4.0, MemoryType.HBM) == 0.0
    order = [MemoryType.LPDDR5, MemoryType.DDR5, MemoryType.DDR4, MemoryType.LPDDR4]
    scores = [cap.memory_score(4.0, 4.0, t) for t in order]
    assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError):
        cap.memory_score(1.0, 0.0, MemoryType.DDR4)


def test_efficiency_network_stability_hand_values() -> None:
    # 1.581 TFLOP/s at 50 W = 31.6 GFLOP/s per watt, the geometric middle of [1, 1000].
    assert cap.efficiency_score(50.0 * math.sqrt(1000.0) / 1000.0, 50.0) == pytest.approx(0.5)
    # A watch (0.03 TFLOP/s, 1 W) is less efficient than a workstation (40 TFLOP/s, 180 W).
    assert cap.efficiency_score(0.03, 1.0) < cap.efficiency_score(40.0, 180.0)
    # 100 Mbit/s is the middle of [1, 10 000]; 10 ms latency costs a factor e.
    assert cap.network_score(100.0, 10.0) == pytest.approx(0.5 / math.e)
    assert cap.network_score(10_000.0, 0.0) == pytest.approx(1.0)
    assert cap.stability_score(0.9, 0.1) == pytest.approx(0.81)


def test_total_is_the_weighted_sum_and_weights_are_checked() -> None:
    dims = np.array([[1.0, 0.5, 0.0, 0.25, 1.0]])
    assert cap.total_score(dims, (0.2, 0.2, 0.2, 0.2, 0.2))[0] == pytest.approx(0.55)
    with pytest.raises(ValueError):
        cap.total_score(dims, (0.5, 0.5, 0.5, 0.0, 0.0))


@given(positive, positive, positive, st.sampled_from(list(cap.CCI_WEIGHTS)))
def test_compute_index_in_unit_interval(fp32: float, int8: float, bw: float, kind: str) -> None:
    assert 0.0 <= cap.compute_index(fp32, int8, bw, kind) <= 1.0


@given(positive, positive, positive, positive)
def test_compute_index_is_monotone_in_flops(
    fp32: float, more: float, int8: float, bw: float
) -> None:
    assert cap.compute_index(fp32 + more, int8, bw) >= cap.compute_index(fp32, int8, bw)


@given(st.floats(0, 1e4), st.floats(0, 1e4), positive, st.sampled_from(list(MemoryType)))
def test_memory_score_bounded_and_monotone(a: float, b: float, need: float, t: MemoryType) -> None:
    low, high = sorted((a, b))
    assert 0.0 <= cap.memory_score(low, need, t) <= cap.memory_score(high, need, t) <= 1.0


@given(positive, positive, positive)
def test_efficiency_bounded_and_falls_with_power(tflops: float, watts: float, more: float) -> None:
    low, high = cap.efficiency_score(tflops, watts + more), cap.efficiency_score(tflops, watts)
    assert 0.0 <= low <= high <= 1.0


@given(positive, st.floats(0, 1e4), st.floats(0, 1e4))
def test_network_bounded_and_falls_with_latency(bw: float, a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert 0.0 <= cap.network_score(bw, high) <= cap.network_score(bw, low) <= 1.0


@given(fraction, fraction, fraction)
def test_stability_bounded_and_monotone(uptime: float, failures: float, more: float) -> None:
    assert (
        0.0
        <= cap.stability_score(uptime, min(1.0, failures + more))
        <= cap.stability_score(uptime, failures)
        <= 1.0
    )


def test_vectorised_over_a_fleet() -> None:
    values = cap.compute_index(
        np.array([0.01, 1.0, 100.0]), np.array([0.1, 10.0, 1000.0]), np.array([10.0, 100.0, 2000.0])
    )
    assert values.shape == (3,)
    assert list(values) == sorted(values)
