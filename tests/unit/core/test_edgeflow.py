"""EdgeFlow, rule by rule, on scenarios small enough to check by hand.

Throughput curve used throughout (iterations/s): 1 GPU 10, 2 GPUs 18, 4 GPUs 30 (sub-linear).
A job of 300 iterations thus ends in 30 s on 1 GPU, 16.7 s on 2, 10 s on 4.
"""

from __future__ import annotations

from libs.core.edgeflow import (
    DlJob,
    EdgeCandidate,
    EdgeServer,
    allocate,
    edge_admission,
    min_satisfactory_share,
)

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


def test_rule_1_a_job_on_the_edge_stays_even_when_gpus_are_free() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]  # 300 iterations at 5/s: 60 s
    result = allocate([job("a", 100.0, edge_server="e1")], 4, edge, 0.0)
    assert result.edge == {"a": "e1"} and result.cloud_gpus == {}
    assert "rule 1" in result.reasons["a"]


def test_rule_1_a_job_missing_its_deadline_on_the_edge_returns_if_the_cloud_saves_it() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]
    # Edge: 60 s > 50 s. Cloud after a 30 s move: 4 GPUs end at 40 s, 2 GPUs at 46.7 s.
    back = allocate([job("a", 50.0, edge_server="e1")], 4, edge, 0.0, migrate_s=30.0)
    assert back.cloud_gpus == {"a": 4} and back.edge == {}  # 2 GPUs, then the 2 left over
    # With only 1 GPU it would end at 60 s in the cloud too: it stays where it runs.
    stays = allocate([job("a", 50.0, edge_server="e1")], 1, edge, 0.0, migrate_s=30.0)
    assert stays.edge == {"a": "e1"}


def test_no_job_holding_gpus_is_moved_to_the_edge() -> None:
    """Rule 2 as first designed, measured harmful (see the module): a waiting job does not take the
    GPUs of jobs that would meet their deadlines on the edge."""
    edge = [EdgeServer(f"e{i}", memory_gb=16.0, speed=1.0) for i in (1, 2)]  # 300 it: 30 s
    a, b = job("a", 35.0), job("b", 100.0)  # 1 GPU each, both meet their deadline on the edge
    wide = job("wide", 40.0, iterations=600.0)  # needs 2 GPUs (33.3 s), 60 s on the edge
    result = allocate([a, wide, b], 2, edge, 0.0, migrate_s=0.0)
    assert result.cloud_gpus == {"a": 1, "b": 1} and result.edge == {}
    assert result.waiting == ("wide",)


def test_rule_3_a_waiting_job_runs_on_the_edge_only_where_it_meets_its_deadline() -> None:
    edge = [EdgeServer("e1", memory_gb=16.0, speed=0.5)]  # 300 iterations: 60 s
    busy = job("busy", 10.0, iterations=100.0)  # 1 GPU: 10 s, takes the only one
    result = allocate([busy, job("can", 80.0), job("cannot", 40.0)], 1, edge, 0.0)
    assert result.edge == {"can": "e1"}
    assert "rule 3" in result.reasons["can"]
    assert result.waiting == ("cannot",)  # it waits for a GPU, as ElasticFlow would


def test_only_jobs_whose_memory_fits_move_to_the_edge() -> None:
    edge = [EdgeServer("e1", memory_gb=8.0, speed=0.5)]
    big = job("big", 200.0, memory_gb=32.0)
    result = allocate([job("busy", 10.0, iterations=100.0), big], 1, edge, 0.0)
    assert result.edge == {}
    assert result.waiting == ("big",)


def test_edge_admission_takes_jobs_that_meet_their_deadline_on_the_slowest_server_that_fits() -> (
    None
):
    # 300 iterations at 10/s on one GPU: 60 s at 0.5 ×, 100 s at 0.3 ×, from t = 10.
    slow, fast = EdgeServer("slow", 16.0, 0.3), EdgeServer("fast", 16.0, 0.5)
    loose = EdgeCandidate("loose", 300.0, 200.0, 10.0, memory_gb=8.0)
    tight = EdgeCandidate("tight", 300.0, 75.0, 10.0, memory_gb=8.0)
    late = EdgeCandidate("late", 300.0, 60.0, 10.0, memory_gb=8.0)  # 70 s even at 0.5 ×
    big = EdgeCandidate("big", 300.0, 500.0, 10.0, memory_gb=32.0)  # no server holds it
    taken = edge_admission([loose, tight, late, big], [fast, slow], 10.0)
    # Earliest deadline first: "tight" needs the fast one; "loose" meets it on the slow one.
    assert taken == {"tight": "fast", "loose": "slow"}
    assert edge_admission([loose], [fast, slow], 10.0) == {"loose": "slow"}
