"""A placement's predicted speed (``libs/core/predict.py``): each stage's compute at its
device's speed, a step's fixed part shared by the streams it carries, each hop paying its
round trips; and corrected by what one placement measured, for its own devices and, by
default, for the others."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libs.core.catalogue import ModelSpec
from libs.core.predict import (
    BYTES_PER_WEIGHT,
    ENGINE_SHARE,
    GBPS_PER_GFLOPS,
    KERNELS,
    READ_SHARE,
    STEP_TOKENS,
    TOKEN_GFLOP,
    TRIPS_PER_STEP,
    Stage,
    corrected,
    factor_of,
    predict,
    step_s,
)

# 16 layers of 25 M parameters and an output layer of 4 M (untied: on the last stage).
MODEL = ModelSpec("m", 16, 25e6, 4e6, 4e6, 1.0, 1000.0, runtime_overhead_gb=0.0)


def whole(device: str = "a", gflops: float = 100.0) -> list[Stage]:
    return [Stage(device, 0, 16, gflops)]


def halves(first: float, second: float, rtt_ms: float = 0.0) -> list[Stage]:
    return [Stage("a", 0, 8, first), Stage("b", 8, 16, second, rtt_ms)]


def test_a_twice_as_fast_device_is_predicted_twice_as_fast_at_any_load() -> None:
    for streams in (1, 8):
        slow = predict(MODEL, whole(gflops=100.0), (streams,)).tokens_per_s[streams]
        fast = predict(MODEL, whole(gflops=200.0), (streams,)).tokens_per_s[streams]
        assert fast == pytest.approx(2 * slow)


def test_streams_share_a_steps_fixed_part_so_more_of_them_give_more_tokens() -> None:
    rates = predict(MODEL, whole(), (1, 8, 64)).tokens_per_s
    assert rates[1] < rates[8] < rates[64]
    # never past what the compute alone allows: only the fixed part is shared
    assert rates[64] / rates[1] < (STEP_TOKENS + 1) / STEP_TOKENS


def test_a_split_costs_each_stage_its_layers_and_the_output_layer_where_it_runs() -> None:
    balanced = step_s(MODEL, halves(100.0, 100.0))
    assert balanced == pytest.approx(step_s(MODEL, whole()))  # no link: the same work
    # the output layer: on the last stage untied, on the first where tied to the embeddings
    slow_last = step_s(MODEL, halves(100.0, 50.0))
    tied = replace(MODEL, tied=True)
    assert step_s(tied, halves(100.0, 50.0)) < slow_last


def test_each_stage_after_the_first_pays_its_links_round_trips() -> None:
    added = step_s(MODEL, halves(100.0, 100.0, rtt_ms=20.0)) - step_s(MODEL, halves(100.0, 100.0))
    assert added == pytest.approx(TRIPS_PER_STEP * 0.020)
    near = predict(MODEL, halves(100.0, 100.0)).ttft_ms
    assert predict(MODEL, halves(100.0, 100.0, rtt_ms=20.0)).ttft_ms > near


def test_a_measured_placement_corrects_its_devices_and_the_default_for_the_others() -> None:
    stages = whole("a")
    predicted = predict(MODEL, stages).tokens_per_s[1]
    factors = corrected({}, stages, predicted, measured=predicted / 2, model=MODEL.name)
    assert predict(MODEL, stages, factors=factors).tokens_per_s[1] == pytest.approx(predicted / 2)
    # a device never measured is predicted with the same ratio
    other = predict(MODEL, whole("b"), factors=factors).tokens_per_s[1]
    assert other == pytest.approx(predicted / 2)
    # measured again, faster: the model's factor on it moves, the defaults stay
    again = corrected(factors, stages, predicted / 2, measured=predicted, model=MODEL.name)
    assert again[f"{MODEL.name}@a"] == pytest.approx(1.0)
    assert again["*"] == factors["*"] and again["a"] == factors["a"]


def test_a_models_correction_is_its_own_where_it_was_measured() -> None:
    """Two models measured on one device keep their own factors (a quantization runs at its
    own share of the device's speed); a third, never measured there, takes the device's
    first, and a model measured elsewhere only, its own from there."""
    other = replace(MODEL, name="other")
    stages = whole("a")
    first = predict(MODEL, stages).tokens_per_s[1]
    factors = corrected({}, stages, first, measured=first / 2, model=MODEL.name)
    second = predict(other, stages, factors=factors).tokens_per_s[1]  # the device's: 2
    assert second == pytest.approx(predict(other, stages).tokens_per_s[1] / 2)
    factors = corrected(factors, stages, second, measured=second * 2, model="other")
    assert factor_of(factors, "a", "other") == pytest.approx(1.0)
    assert factor_of(factors, "a", MODEL.name) == pytest.approx(2.0)
    assert factor_of(factors, "a", "third") == pytest.approx(2.0)  # the device's, first known
    # On b, predicted with the default (2) and measured half as fast again: 4 there, and
    # for the third model on devices it was never measured on; the default stays.
    elsewhere = corrected(factors, whole("b"), 10.0, measured=5.0, model="third")
    assert factor_of(elsewhere, "c", "third") == pytest.approx(4.0)
    assert factor_of(elsewhere, "c", MODEL.name) == pytest.approx(2.0)


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        predict(MODEL, [])
    with pytest.raises(ValueError, match="positive"):
        corrected({}, whole(), 10.0, 0.0)


def test_watts_are_each_devices_idle_draw_plus_its_span_for_the_share_it_computes() -> None:
    [alone] = [replace(s, idle_w=10.0, max_w=60.0) for s in whole()]
    assert predict(MODEL, [alone], (1,)).watts[1] == pytest.approx(60.0)  # busy all the step
    far = [replace(s, idle_w=10.0, max_w=60.0) for s in halves(100.0, 100.0, rtt_ms=50.0)]
    guess = predict(MODEL, far, (1, 8))
    # Each computes less than half a step (the other's half and the link's round trips).
    assert 20.0 < guess.watts[1] < 10.0 + 10.0 + 50.0
    assert guess.watts[1] < guess.watts[8]  # more streams: more of each step is compute


def test_a_files_weight_types_run_at_their_kernels_measured_rates() -> None:
    """The same sizes in two types: each at its kernels' share; a type never measured between
    the measured ones; sizes without types at the default share."""
    typed = {t: replace(MODEL, layer_types=((t, 1.0),), output_type=t) for t in KERNELS}
    rates = {t: predict(m, whole(), (8,)).tokens_per_s[8] for t, m in typed.items()}
    slow, fast = min(rates, key=rates.__getitem__), max(rates, key=rates.__getitem__)
    assert rates["F32"] < rates["Q4_0"]  # four times the bytes, a slower kernel
    unknown = replace(MODEL, layer_types=(("Q9_9", 1.0),), output_type="Q9_9")
    assert rates[slow] < predict(unknown, whole(), (8,)).tokens_per_s[8] < rates[fast]
    untyped = predict(MODEL, whole(), (1,)).tokens_per_s[1]
    expected = 100.0 * ENGINE_SHARE / (2 * (16 * 25e6 + 4e6) / 1e9 * (STEP_TOKENS + 1))
    assert untyped == pytest.approx(expected)


def test_a_mixed_file_costs_each_of_its_types_share_of_the_weights() -> None:
    a, b = "Q4_K", "Q6_K"
    mixed = replace(MODEL, layer_types=((a, 0.5), (b, 0.5)), output_type=a)
    only = {t: replace(MODEL, layer_types=((t, 1.0),), output_type=a) for t in (a, b)}
    step = {t: step_s(m, whole()) for t, m in only.items()}
    assert step_s(mixed, whole()) == pytest.approx((step[a] + step[b]) / 2)


def test_the_tokens_own_work_is_the_first_stages() -> None:
    """Sampling and the server's work run where llama-server runs: a slow head costs it."""
    typed = replace(MODEL, layer_types=(("Q8_0", 1.0),), output_type="Q8_0", tied=True)
    fast_head = step_s(typed, halves(200.0, 100.0))
    slow_head = [Stage("a", 0, 8, 100.0), Stage("b", 8, 16, 200.0)]
    assert step_s(typed, slow_head) > fast_head
    assert TOKEN_GFLOP[1] > 0


def test_a_step_reads_its_weights_once_at_the_bandwidth_its_device_calibrated() -> None:
    """A neighbour that takes the memory bus (half the bandwidth, the same FLOP/s) slows the
    part of a step that reads the weights, once per step whatever its streams: one stream
    loses more than eight. A device with no bandwidth known reads at the fit's ratio."""
    q8 = replace(MODEL, layer_types=(("Q8_0", 1.0),), output_type="Q8_0")
    stage = Stage("a", 0, 16, 100.0, memory_gbps=30.0)
    starved = replace(stage, memory_gbps=15.0)
    read_s = (16 * 25e6 + 4e6) * BYTES_PER_WEIGHT["Q8_0"] / 1e9 / (30.0 * READ_SHARE)
    for streams in (1, 8):
        assert step_s(q8, [starved], streams) - step_s(q8, [stage], streams) == pytest.approx(
            read_s
        )
    one, eight = (predict(q8, [s], (1, 8)).tokens_per_s for s in (stage, starved))
    assert eight[1] / one[1] < eight[8] / one[8] < 1.0
    guessed = replace(stage, memory_gbps=0.0)
    known = replace(stage, memory_gbps=100.0 * GBPS_PER_GFLOPS)
    assert step_s(q8, [guessed]) == pytest.approx(step_s(q8, [known]))
