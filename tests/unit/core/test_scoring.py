"""Batch scoring of a fleet: hand-computed dimensions and the stability history."""

from __future__ import annotations

import math

import numpy as np
import pytest

from libs.core.scoring import score_batch, uptime_and_failure_rate


def test_batch_scores_match_hand_values() -> None:
    dims = score_batch(
        compute=np.array([0.5, 1.0]),
        fp32_tflops=np.array([50.0 * math.sqrt(1000.0) / 1000.0, 50.0]),
        memory_type_score=np.array([0.85, 0.55]),
        typical_power_w=np.array([50.0, 500.0]),
        memory_available_gb=np.array([1.0, 8.0]),
        network_bandwidth_mbps=np.array([100.0, 10_000.0]),
        network_rtt_ms=np.array([10.0, 0.0]),
        uptime_ratio=np.array([1.0, 0.9]),
        failure_rate=np.array([0.0, 0.1]),
        weights=(0.2, 0.2, 0.2, 0.2, 0.2),
        reference_need_gb=2.0,
    )
    assert dims.memory[0] == pytest.approx(0.5 * 0.85)  # 1 GB of 2 GB needed
    assert dims.memory[1] == pytest.approx(0.55)
    assert dims.efficiency[0] == pytest.approx(0.5)  # 31.6 GFLOP/s per W of [1, 1000]
    assert dims.efficiency[1] == pytest.approx(2 / 3)  # 50 TFLOP/s at 500 W: 100 per W
    assert dims.network[0] == pytest.approx(0.5 / math.e)
    assert dims.stability[1] == pytest.approx(0.81)
    row = dims.row(0)
    assert row["total"] == pytest.approx(0.2 * (0.5 + 0.5 * 0.85 + 0.5 + 0.5 / math.e + 1.0))


def test_history_to_uptime_and_failure_rate() -> None:
    uptime, rate = uptime_and_failure_rate(
        np.array([7200.0, 100.0]), np.array([720.0, 0.0]), np.array([5.0, 0.0])
    )
    assert uptime[0] == pytest.approx(0.9)
    assert rate[0] == pytest.approx(2.5 / 10)  # 5 failures in 2 h = 2.5 per hour
    assert (uptime[1], rate[1]) == (1.0, 0.0)
