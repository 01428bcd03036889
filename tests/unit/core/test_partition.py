"""Model partitioning: capacity-proportional contiguous shards that fit, or a reason."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.contracts import DEFAULT_CONTEXT_TOKENS, DeviceClass
from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.migration import replan_deployment
from libs.core.partition import (
    choose,
    fastest_split,
    largest_remainder,
    memory_proportional,
    plan,
    previews,
    split_layers,
    step_ms,
    whole_models_only,
)
from tests.builders import make_device

#: SmolLM2 in float32 (the hand-checked memory figures below are for 4 bytes a weight).
SMOL = dataclasses.replace(
    HYPOTHETICAL_MODELS["smollm2-135m-instruct"], bytes_per_param=4.0, tied=False
)
LLAMA8 = HYPOTHETICAL_MODELS["llama-3.1-8b-instruct"]


def three_devices(**over: float) -> list:  # type: ignore[type-arg]
    return [
        make_device("big", memory_free_gb=8.0, speed=100.0, **over),
        make_device("mid", memory_free_gb=4.0, speed=50.0, **over),
        make_device("small", memory_free_gb=2.0, speed=25.0, **over),
    ]


def test_a_30_layer_model_on_3_devices_follows_capacity_and_fits() -> None:
    counts, reason = split_layers(SMOL, three_devices(), DEFAULT_CONTEXT_TOKENS)
    # The balanced split: capacity shares are 4/7, 2/7, 1/7 of the 27 spare layers (+1 each).
    assert (counts, reason) == ([16, 9, 5], None)
    option = plan(SMOL, three_devices())
    assert option.feasible
    layers = [s.layers for s in option.shards]
    assert sum(layers) == 30
    assert [s.layer_start for s in option.shards] == [0, layers[0], layers[0] + layers[1]]
    # A step runs the stages one after another: the fastest device takes every layer its 8 GB
    # holds, the others one each, and that is estimated faster than the balanced split.
    assert layers == [28, 1, 1]
    assert option.step_ms is not None
    assert option.step_ms < step_ms(SMOL, three_devices(), [16, 9, 5])
    for shard, device in zip(option.shards, three_devices(), strict=True):
        assert shard.memory_gb <= device.memory_free_gb


def test_the_fastest_split_fills_the_fastest_device_up_to_its_memory() -> None:
    # "big" holds only 12 layers: the next fastest takes the rest it can hold.
    devices = three_devices()
    devices[0] = dataclasses.replace(
        devices[0], memory_free_gb=SMOL.shard_gb(12, True, False, 4096)
    )
    counts = fastest_split(SMOL, devices, 4096)
    assert counts is not None and counts[0] == 12 and sum(counts) == 30 and counts[2] >= 1
    assert counts[1] == 30 - 12 - counts[2]


def test_devices_of_about_the_same_speed_keep_the_balanced_split() -> None:
    # 3 % apart (a calibration's noise): the fastest split is not estimated 5 % faster.
    devices = [
        make_device("a", memory_free_gb=8.0, speed=103.0),
        make_device("b", memory_free_gb=8.0, speed=100.0),
    ]
    option = plan(SMOL, devices)
    assert [s.layers for s in option.shards] == [15, 15]


def test_a_step_given_by_the_caller_decides_the_split() -> None:
    # An estimate where every layer costs the same wherever it runs: nothing is faster than
    # the balanced split, so it is kept.
    option = plan(SMOL, three_devices(), step=lambda model, devices, counts: 1.0)
    assert [s.layers for s in option.shards] == [16, 9, 5] and option.step_ms == 1.0


def test_layers_move_off_a_device_whose_share_does_not_fit() -> None:
    # "fast" is fast but short of memory: its capacity share would not fit.
    devices = [
        make_device("fast", memory_free_gb=0.55, speed=1000.0),
        make_device("roomy", memory_free_gb=16.0, speed=10.0),
    ]
    option = plan(SMOL, devices)
    assert option.feasible
    fast = option.shards[0]
    assert fast.memory_gb <= 0.55
    assert SMOL.shard_gb(fast.layers + 1, True, False, 2048) > 0.55
    assert fast.layers < 15  # what its capacity share alone would have given it


@pytest.mark.parametrize(
    ("memory", "reason"),
    [
        ((4.0, 4.0, 4.0), "needs about 17.38 GB, these devices have 12.00 GB free"),
        ((8.0, 8.0, 0.1), "small cannot hold even one layer"),
    ],
)
def test_infeasible_fleets_say_why(memory: tuple[float, ...], reason: str) -> None:
    devices = [
        make_device(name, DeviceClass.WORKSTATION, memory_free_gb=m)
        for name, m in zip(("a", "b", "small"), memory, strict=True)
    ]
    option = plan(LLAMA8, devices, context_length=8192)
    assert not option.feasible
    assert option.reason is not None and reason in option.reason


def test_previews_list_every_option_with_memory_or_reason() -> None:
    fleet = [make_device(f"ws{i}", DeviceClass.WORKSTATION, memory_free_gb=7.0) for i in range(4)]
    options = previews(LLAMA8, fleet, context_length=4096, max_shards=4)
    assert [len(o.devices) for o in options] == [1, 2, 3, 4]
    assert [o.feasible for o in options] == [False, False, True, True]
    assert all("memory" in (o.reason or "") for o in options[:2])
    assert all(s.memory_gb <= 7.0 for o in options[2:] for s in o.shards)
    assert len(choose(options).devices) == 3  # fewest hops among the feasible


def test_a_poor_network_prefers_fewer_devices() -> None:
    def fleet(rtt: float) -> list:  # type: ignore[type-arg]
        return [make_device("a", memory_free_gb=8.0, speed=5.0, network_rtt_ms=rtt)] + [
            make_device(f"fast{i}", memory_free_gb=8.0, speed=50.0, network_rtt_ms=rtt)
            for i in range(3)
        ]

    good = choose(previews(SMOL, fleet(0.1)))
    poor = choose(previews(SMOL, fleet(200.0)))
    assert len(poor.devices) == 1
    assert len(good.devices) >= len(poor.devices)


def test_replanning_after_a_failure_avoids_the_failed_device() -> None:
    option = replan_deployment(SMOL, three_devices(), {"big"}, 2048, 3)
    assert option.feasible and "big" not in option.devices


@given(st.integers(1, 200), st.lists(st.floats(0, 100), min_size=1, max_size=20))
def test_largest_remainder_sums_and_respects_the_minimum(total: int, weights: list[float]) -> None:
    if total < len(weights):
        with pytest.raises(ValueError):
            largest_remainder(total, weights)
        return
    counts = largest_remainder(total, weights)
    assert sum(counts) == total and min(counts) >= 1


def test_a_failed_devices_tasks_move_to_the_best_alternatives() -> None:
    import numpy as np

    from libs.core.dwps import Dwps
    from libs.core.fleet_state import FleetState
    from libs.core.migration import replace_tasks
    from tests.builders import make_task

    fleet = FleetState(three_devices(slots=4))
    tasks = [make_task(f"t{i}", intensity=0.05) for i in range(3)]
    placed = replace_tasks(Dwps(), fleet, "big", tasks, 0.0, np.random.default_rng(0))
    assert sorted(p.task_id for p in placed) == [t.task_id for t in tasks]  # every one moved
    assert all(p.device_id in {"mid", "small"} for p in placed)


def test_a_whole_model_engine_takes_whole_models_but_never_one_shard_of_several() -> None:
    options = previews(SMOL, three_devices(), 2048, 3)
    cut = next(o for o in options if o.feasible and len(o.shards) > 1 and "big" in o.devices)
    refused = whole_models_only(cut, {"big"})
    assert not refused.feasible and "big serve whole models only" in (refused.reason or "")
    assert whole_models_only(cut, {"elsewhere"}) == cut
    whole = next(o for o in options if o.feasible and o.devices == ("big",))
    assert whole_models_only(whole, {"big"}) == whole
    best = choose([whole_models_only(o, {"big"}) for o in options])
    assert best.feasible and ("big" not in best.devices or len(best.shards) == 1)


def test_exo_splits_by_memory_alone_on_the_largest_memory_devices() -> None:
    seventy = HYPOTHETICAL_MODELS["llama-3.1-70b-instruct"]  # about 141 GB in fp16
    devices = [
        make_device(
            "slow-big",
            DeviceClass.WORKSTATION,
            memory_free_gb=80.0,
            memory_total_gb=128.0,
            speed=1000.0,
        ),
        make_device(
            "fast-mid",
            DeviceClass.WORKSTATION,
            memory_free_gb=60.0,
            memory_total_gb=128.0,
            speed=8000.0,
        ),
        make_device(
            "fast-small",
            DeviceClass.WORKSTATION,
            memory_free_gb=40.0,
            memory_total_gb=128.0,
            speed=8000.0,
        ),
        make_device("tiny", DeviceClass.PHONE, memory_free_gb=4.0, speed=8000.0),
    ]
    exo = memory_proportional(seventy, devices)
    assert exo.devices == ("slow-big", "fast-mid", "fast-small")  # the fewest that hold it
    assert [s.layers for s in exo.shards] == [35, 27, 18]  # 80 layers ∝ 80 : 60 : 40 GB
    ours = choose(previews(seventy, devices))
    assert ours.feasible and ours.step_ms is not None and exo.step_ms is not None
    assert ours.step_ms < exo.step_ms  # fewer layers on the slow device
