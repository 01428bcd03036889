"""EdgeFlow, rule by rule, on scenarios small enough to check by hand.

Throughput curve used throughout (iterations/s): 1 GPU 10, 2 GPUs 18, 4 GPUs 30 (sub-linear).
A job of 300 iterations thus ends in 30 s on 1 GPU, 16.7 s on 2, 10 s on 4.
"""

from __future__ import annotations

from libs.core.edgeflow import DlJob, EdgeServer, allocate, min_satisfactory_share

CURVE = {1: 10.0, 2: 18.0, 4: 30.0}


def job(job_id: str, deadline: float, iterations: float = 300.0, **kw: object) -> DlJob:
    return DlJob(job_id, iterations, deadline, CURVE, **kw)  # type: ignore[arg-type]


def test_minimum_satisfactory_share_is_the_fewest_gpus_that_meet_the_deadline() -> None:
    assert min_satisfactory_share(job("a", 40.0), 0.0) == 1
    assert min_satisfactory_share(job("a", 20.0), 0.0) == 2
    assert min_satisfactory_share(job("a", 12.0), 0.0) == 4
    assert min_satisfactory_share(job("a", 5.0), 0.0) is None


def test_shares_go_earliest_deadline_first_and_the_rest_wait() -> None:
    result = allocate([job("late", 20.0), job("early", 19.0), job("third", 18.5)], 4, [], 0.0)
    assert result.cloud_gpus == {"third": 2, "early": 2}
    assert result.waiting == ("late",)


def test_leftover_gpus_go_to_the_largest_gain_per_extra_gpu() -> None:
    # a: 1 → 2 GPUs saves 30 − 16.7 = 13.3 s for 1 GPU; b (100 iterations) saves only 4.4 s.
    result = allocate([job("a", 100.0), job("b", 100.0, iterations=100.0)], 3, [], 0.0)
    assert result.cloud_gpus == {"a": 2, "b": 1}
    assert "largest gain" in result.reasons["a"]


def test_rule_1_jobs_already_on_the_edge_stay() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]
    result = allocate([job("a", 100.0, on_edge=True)], 4, edge, 0.0)
    assert result.edge == {"a": "e1"} and result.cloud_gpus == {}
    assert "rule 1" in result.reasons["a"]


def test_rule_2_only_when_the_cloud_is_full_and_only_if_the_deadline_holds() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]  # 300 iterations at 5/s: 60 s
    relaxed, tight = job("relaxed", 100.0), job("tight", 20.0)
    full = allocate([relaxed, tight], 3, edge, 0.0)  # shares 1 + 2 use all 3 GPUs
    assert full.edge == {"relaxed": "e1"}
    assert full.cloud_gpus["tight"] >= 2
    roomy = allocate([relaxed, tight], 8, edge, 0.0)  # spare GPUs: nothing moves
    assert roomy.edge == {}


def test_rule_3_hopeless_jobs_go_to_the_edge_and_free_gpus_for_savable_ones() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]
    hopeless = job("hopeless", 5.0)  # cannot finish by 5 s even on 4 GPUs
    savable = job("savable", 12.0)  # needs all 4 GPUs
    result = allocate([hopeless, savable], 4, edge, 0.0)
    assert result.edge == {"hopeless": "e1"}
    assert result.cloud_gpus == {"savable": 4}
    assert "rule 3" in result.reasons["hopeless"]


def test_only_jobs_whose_memory_fits_move_to_the_edge() -> None:
    edge = [EdgeServer("e1", memory_gb=8.0, speed=0.5)]
    big = job("big", 5.0, memory_gb=32.0)
    result = allocate([big], 4, edge, 0.0)
    assert result.edge == {}
    assert result.cloud_gpus == {"big": 4}  # best effort with what the cloud has
