"""The Batch API's live policies (``libs/core/batch_policies.py``): what a user submitting
batches sees under each, on a measured, sub-linear curve (eight requests at once make three
times the tokens of one, not eight)."""

from __future__ import annotations

from typing import get_args

from libs.core.batch_policies import (
    POLICIES,
    Batch,
    Lane,
    admit_batch,
    edge_lane,
    rescued,
    shares,
)
from services.gateway.settings import GatewaySettings

CURVE = {1: 10.0, 2: 16.0, 4: 24.0, 8: 30.0}  # tokens/s by requests at once


def batch(name: str, deadline_s: float, arrived_s: float = 0.0, requests: int = 8) -> Batch:
    return Batch(name, requests, 30, deadline_s, arrived_s, CURVE)  # 240 tokens for 8


def test_the_gateway_takes_each_policy_by_name() -> None:
    assert get_args(GatewaySettings.model_fields["batch_policy"].annotation) == POLICIES


def test_elastic_shares_meet_two_deadlines_that_one_after_the_other_cannot() -> None:
    """Both at four streams end in 10 s; one after the other at eight, the second ends at 16."""
    a, b = batch("a", deadline_s=11.0), batch("b", deadline_s=12.0)
    edf = admit_batch("edf", [a], b, now=0.0, streams=8)
    assert not edf.admitted and edf.planned_finish_s == 16.0
    elastic = admit_batch("elasticflow", [a], b, now=0.0, streams=8)
    assert elastic.admitted and elastic.planned_finish_s == 10.0
    assert shares("elasticflow", [a, b], 0.0, 8) == {"a": 4, "b": 4}
    assert shares("edf", [a, b], 0.0, 8) == {"a": 8, "b": 0}


def test_leftover_streams_go_where_they_gain_the_most() -> None:
    """A roomy deadline needs one stream; the other seven are not left idle."""
    roomy = batch("roomy", deadline_s=3600.0)
    given = shares("elasticflow", [roomy], 0.0, 8)
    assert given == {"roomy": 8}
    two = batch("two", deadline_s=3600.0, requests=2)
    assert shares("elasticflow", [two], 0.0, 8) == {"two": 2}  # no more than its requests


def test_fifo_serves_arrivals_in_order_and_declines_what_would_need_to_jump_the_queue() -> None:
    early = batch("early", deadline_s=100.0, arrived_s=0.0)
    urgent = batch("urgent", deadline_s=10.0, arrived_s=1.0)
    fifo = admit_batch("fifo", [early], urgent, now=1.0, streams=8)
    assert not fifo.admitted and "needs about 8 s of serving" in fifo.reason
    assert admit_batch("edf", [early], urgent, now=1.0, streams=8).admitted  # it runs first
    later = batch("later", deadline_s=100.0, arrived_s=2.0)
    assert shares("fifo", [later, early], 2.0, 8) == {"early": 8, "later": 0}


def test_a_decline_says_what_the_batch_needs_under_each_policy() -> None:
    for policy in POLICIES:
        decision = admit_batch(policy, [], batch("big", deadline_s=5.0), now=0.0, streams=8)
        assert not decision.admitted, policy
        assert "needs about 8 s of serving" in decision.reason, (policy, decision.reason)
    unmeasured = Batch("b", 4, 30, 100.0, 0.0, {})
    assert "no throughput measured" in admit_batch("elasticflow", [], unmeasured, 0.0, 8).reason


def test_a_batch_smaller_than_the_streams_measured_runs_in_one_wave() -> None:
    """edf measures only at every stream: two requests then take one request's time at the
    pace each of eight runs at (the earlier wave rule), not "no throughput measured"."""
    two = Batch("two", 2, 30, 100.0, 0.0, {8: 30.0})
    assert two.seconds(8) == 8.0  # 30 tokens at 30/8 tokens/s each
    decision = admit_batch("edf", [], two, now=0.0, streams=8)
    assert decision.admitted and decision.planned_finish_s == 8.0


def test_a_batch_already_late_does_not_close_elasticflow_to_every_new_one() -> None:
    late = batch("late", deadline_s=1.0)  # 8 s of work, 1 s left: late whatever comes
    roomy = batch("roomy", deadline_s=3600.0)
    assert admit_batch("elasticflow", [late], roomy, now=0.0, streams=8).admitted
    squeezed = batch("squeezed", deadline_s=12.0)
    held = batch("held", deadline_s=11.0)  # the 4 + 4 streams case: a third one fits no more
    decision = admit_batch("elasticflow", [held, squeezed], batch("third", 11.5), 0.0, 8)
    assert not decision.admitted


def test_edgeflow_runs_elasticflows_cloud_and_sends_what_it_declines_to_an_idle_edge() -> None:
    """The cloud decides as elasticflow does; a batch it declines goes to the slowest idle
    edge deployment that still ends it by its deadline (the fast one stays free)."""
    a, b = batch("a", deadline_s=11.0), batch("b", deadline_s=12.0)
    assert admit_batch("edgeflow", [a], b, 0.0, 8) == admit_batch("elasticflow", [a], b, 0.0, 8)
    assert shares("edgeflow", [a, b], 0.0, 8) == shares("elasticflow", [a, b], 0.0, 8)
    late = batch("late", deadline_s=9.0)  # beside a, no share of the cloud ends it by 9 s
    assert not admit_batch("edgeflow", [a], late, 0.0, 8).admitted
    fast = Lane("smol-desk", {k: 2 * r for k, r in CURVE.items()})  # 240 tokens in 4 s
    slow = Lane("smol-laptop", CURVE)  # 8 s
    crawl = Lane("smol-phone", {k: r / 4 for k, r in CURVE.items()})  # 32 s: too late
    taken = edge_lane(late, [crawl, fast, slow], 0.0, 8)
    assert taken is not None
    lane, decision = taken
    assert lane == "smol-laptop" and decision.admitted and decision.planned_finish_s == 8.0
    assert "smol-laptop" in decision.reason
    assert edge_lane(late, [crawl], 0.0, 8) is None  # none ends it in time: declined
    assert edge_lane(late, [], 0.0, 8) is None


def test_a_batch_the_cloud_now_misses_goes_to_an_idle_edge_and_one_it_meets_stays() -> None:
    """Rules 2 and 3 made safe: admitted batches whose model now measures slower than it did
    (a quarter of the curve: 240 tokens at 8 streams take 32 s), the least able first, each to
    an idle edge lane on which it ends in time; one the cloud still ends in time stays."""
    slowed = {k: r / 4 for k, r in CURVE.items()}
    tight = Batch("tight", 8, 30, 10.0, 0.0, slowed)  # planned first: ends at 32 s, 22 late
    looser = Batch("looser", 8, 30, 20.0, 0.0, slowed)  # after it: ends at 64 s, 44 late
    roomy = Batch("roomy", 1, 30, 3600.0, 0.0, slowed)  # ends in time: stays
    fast = Lane("smol-desk", {k: 2 * r for k, r in CURVE.items()})  # 240 tokens in 4 s
    slow = Lane("smol-laptop", CURVE)  # 8 s
    both = {b.job_id: [fast, slow] for b in (roomy, looser, tight)}
    moved = rescued([roomy, looser, tight], both, 0.0, 8)
    # The least able takes the slowest lane that still ends it in time; the next the other.
    assert moved == {"looser": "smol-laptop", "tight": "smol-desk"}
    one = {"looser": [slow], "tight": [slow]}
    assert rescued([roomy, looser, tight], one, 0.0, 8) == {"looser": "smol-laptop"}
    # Only its own model's lanes: tight's model has the fast one alone.
    own = {"looser": [slow], "tight": [fast]}
    assert rescued([looser, tight], own, 0.0, 8) == {"looser": "smol-laptop", "tight": "smol-desk"}
    crawl = Lane("smol-phone", {k: r / 8 for k, r in CURVE.items()})  # too slow for either
    assert rescued([looser, tight], {"looser": [crawl], "tight": [crawl]}, 0.0, 8) == {}
    on_time = [batch("a", deadline_s=11.0), batch("b", deadline_s=12.0)]  # both met together
    assert rescued(on_time, {"a": [fast, slow], "b": [fast, slow]}, 0.0, 8) == {}
