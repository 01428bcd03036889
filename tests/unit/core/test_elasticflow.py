"""ElasticFlow's planning rules (``libs/core/elasticflow.py``), checked by hand.

Throughput used throughout (iterations/s): 1 GPU 10, 2 GPUs 18, 4 GPUs 30.
"""

from __future__ import annotations

import numpy as np
import pytest

from libs.core.elasticflow import (
    PlanJob,
    Timeline,
    baseline_max_gpu,
    elasticflow_max_gpu,
    overhead_s,
    plan_all,
    plan_job,
    share_leftover,
)

CURVE = {1: 10.0, 2: 18.0, 4: 30.0}


def test_each_job_gets_the_fewest_gpus_that_meet_its_deadline_in_deadline_order() -> None:
    # Slots of 100 s on 4 GPUs. "b": 2,000 iterations by t = 100 needs all 4 (2 GPUs do only
    # 1,800). "a": 2,000 by t = 150 then has only the first 50 s of slot 1: 1,500 on 4 GPUs.
    a = PlanJob("a", 2000, 150, CURVE)
    b = PlanJob("b", 2000, 100, CURVE)
    plans, _ = plan_all([a, b], 4, 0.0, slot_s=100.0)
    assert list(plans["b"].gpus_by_slot) == [4]  # the earlier deadline is planned first
    assert plans["b"].meets_deadline
    assert not plans["a"].meets_deadline
    # "c": 2,000 by t = 250, from slot 1: 1 GPU does 1,500 by then, 2 GPUs 2,700.
    c = PlanJob("c", 2000, 250, CURVE)
    plans, _ = plan_all([b, c], 4, 0.0, slot_s=100.0)
    assert list(plans["c"].gpus_by_slot) == [0, 2, 2]
    assert plans["c"].end_s == pytest.approx(200 + 200 / 18)  # 1,800 in slot 1, then 200


def test_an_edge_tail_lets_the_cloud_hold_a_job_for_less() -> None:
    timeline = Timeline(1, 0.0, 10.0, np.array([1, 0, 0, 0]))  # only slot 0 has a free GPU
    alone = PlanJob("a", 300, 40, {1: 10.0})
    assert not plan_job(alone, Timeline(1, 0.0, 10.0, np.array([1, 0, 0, 0]))).meets_deadline
    # Slot 0 on the GPU (100 iterations), then 30 s on an edge server: 5/s is too slow,
    # 7/s does the remaining 200.
    slow = PlanJob("a", 300, 40, {1: 10.0}, tail_rate=5.0)
    assert not plan_job(slow, Timeline(1, 0.0, 10.0, np.array([1, 0, 0, 0]))).meets_deadline
    fast = PlanJob("a", 300, 40, {1: 10.0}, tail_rate=7.0)
    plan = plan_job(fast, timeline)
    assert plan.meets_deadline and list(plan.gpus_by_slot) == [1]


def test_leftover_gpus_start_a_waiting_job_then_go_by_their_marginal_gpu_time() -> None:
    # Their code ranks a step by the GPU-seconds it adds, largest first. a: 1 → 2 GPUs makes
    # its 300 iterations take 2 × 16.7 = 33.3 GPU-seconds instead of 30 (+3.3); b: 100
    # iterations, +1.1. The waiting job w comes before both.
    a = PlanJob("a", 300, 1000, CURVE)
    b = PlanJob("b", 100, 1000, CURVE)
    waiting = PlanJob("w", 100, 1000, CURVE)
    assert share_leftover([a, b, waiting], {"a": 1, "b": 1}, 2) == {"a": 2, "b": 1, "w": 1}
    # A job that scales perfectly adds no GPU-seconds: it comes last, though it saves the most
    # time (15 s against a's 13.3 s).
    linear = PlanJob("c", 300, 1000, {1: 10.0, 2: 20.0})
    assert share_leftover([a, linear], {"a": 1, "c": 1}, 1) == {"a": 2, "c": 1}
    assert share_leftover([b, waiting], {"b": 1}, 1) == {"b": 1, "w": 1}


def test_gpu_count_rules_follow_their_code() -> None:
    assert elasticflow_max_gpu("bert", 64) == 8 and elasticflow_max_gpu("bert", 128) == 16
    assert elasticflow_max_gpu("gpt2", 128) == 16 and elasticflow_max_gpu("deepspeech2", 32) == 32
    assert elasticflow_max_gpu("resnet50", 256) == 64 and elasticflow_max_gpu("vgg16", 64) == 32
    assert baseline_max_gpu(CURVE, 64) == 4 and baseline_max_gpu(CURVE, 2) == 2
    assert baseline_max_gpu({g: 1.0 for g in (1, 2, 4, 8, 16, 32, 64, 128)}, 256) == 64


def test_overheads_are_their_constants() -> None:
    assert overhead_s(8, rescaled=False, restart=False, cluster_gpus=128) == 2.0
    assert overhead_s(8, rescaled=True, restart=False, cluster_gpus=128) == 2.0 + 4 * 2
    assert overhead_s(8, rescaled=False, restart=True, cluster_gpus=128) == 2.0 + 27 + 4 * 2
    assert overhead_s(1, rescaled=True, restart=False, cluster_gpus=512) == 7.0 + 2
