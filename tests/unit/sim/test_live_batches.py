"""The live batch policies in the simulator (``libs/sim/batches.py``): the same admission and
shares as the gateway's runner, at measured curves, for the prediction ``bench/jobs_live.py``
prints beside its measurement."""

from __future__ import annotations

import pytest

from libs.sim.batches import Arrival, rate_at, simulate

CURVE = {1: 10.0, 2: 16.0, 4: 24.0, 8: 30.0}  # tokens/s by requests at once
EDGE = {"smol-laptop": CURVE}


def test_a_batch_alone_ends_when_its_tokens_are_made_at_the_streams_it_holds() -> None:
    # 8 requests of 30 tokens at 8 at once: 240 tokens at 30/s, 8 s; a 10 s window is met.
    out = simulate("edf", [Arrival(0.0, 8, 30, 10.0)], CURVE, 8)
    assert (out.admitted, out.declined, out.met) == (1, 0, 1)
    assert out.deadlines_met == 1.0
    assert simulate("edf", [Arrival(0.0, 8, 30, 5.0)], CURVE, 8).declined == 1


def test_edgeflow_runs_on_the_edge_what_the_cloud_declines() -> None:
    # The second batch, due before the first can end beside it, fits no share of the cloud;
    # an idle edge copy of the model ends it in 8 s.
    mix = [Arrival(0.0, 8, 30, 9.0), Arrival(0.5, 8, 30, 9.5)]
    cloud = simulate("elasticflow", mix, CURVE, 8)
    assert (cloud.admitted, cloud.declined) == (1, 1)
    both = simulate("edgeflow", mix, CURVE, 8, EDGE)
    assert (both.admitted, both.declined, both.met) == (2, 0, 2)
    assert both.each == [("met", ""), ("met", "smol-laptop")]
    # Busy with one batch, the edge takes no second one.
    three = simulate("edgeflow", [*mix, Arrival(1.0, 8, 30, 9.5)], CURVE, 8, EDGE)
    assert three.each[2] == ("declined", "")


def test_a_rate_between_measured_points_is_the_one_below() -> None:
    assert rate_at(CURVE, 3) == 16.0 and rate_at(CURVE, 8) == 30.0
    assert rate_at({2: 16.0}, 1) == pytest.approx(8.0)  # below the fewest: scaled down


def test_requests_that_stop_early_end_their_batch_early_though_admission_plans_for_all() -> None:
    # 8 requests of up to 30 tokens at 8 at once: planned 240 tokens at 30/s, 8 s, so a 5 s
    # window is declined whatever they make; requests that stop at 10 tokens end in 8/3 s.
    assert simulate("edf", [Arrival(0.0, 8, 30, 5.0, made=10.0)], CURVE, 8).declined == 1
    full = simulate("edf", [Arrival(0.0, 8, 30, 9.0)], CURVE, 8)
    short = simulate("edf", [Arrival(0.0, 8, 30, 9.0, made=10.0)], CURVE, 8)
    assert full.took_s[0] == pytest.approx(8.0, abs=0.11)
    assert short.took_s[0] == pytest.approx(8.0 / 3, abs=0.11)


def test_a_cloud_batch_whose_plan_turns_late_moves_to_an_idle_edge_lane() -> None:
    """The runner's rescue, in the simulator: a batch admitted on the cloud at the curve it
    was planned on, whose plan at the cloud's rates now ends after its deadline, moves to the
    idle lane that ends it in time once no wave of it is in flight; one in time stays."""
    from libs.sim.batches import Mix, Running

    slow = {k: r / 4 for k, r in CURVE.items()}  # the cloud, measured four times slower
    mix = Mix("edgeflow", slow, 8, EDGE)
    late = Running(Arrival(0.0, 8, 30, 10.0), "late", "", 8)  # 32 s at the cloud's rates
    roomy = Running(Arrival(0.0, 1, 30, 3600.0), "roomy", "", 1)
    mid_wave = Running(Arrival(0.0, 8, 30, 10.0), "mid-wave", "", 8, in_wave=8)
    mix.rescue([late, roomy, mid_wave], 0.0)
    assert (late.lane, roomy.lane, mid_wave.lane) == ("smol-laptop", "", "")
    Mix("elasticflow", slow, 8, EDGE).work([again := Running(late.arrival, "x", "", 8)], 0.0, 0.1)
    assert again.lane == ""  # only edgeflow rescues
