"""Placement counts each layer at its own size: a mixed quantization (Q4_K_M keeps some layers
wider) must not be split as if every layer weighed the mean."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.core.catalogue import GB, HYPOTHETICAL_MODELS, ModelSpec, card_spec
from libs.core.partition import plan, previews
from tests.builders import make_device

#: 20 layers of 0.2 GB on average, embeddings and head of 0.1 GB each, no KV cache or overhead.
EVEN = ModelSpec("even", 20, 0.2e9, 0.1e9, 0.1e9, 1.0, 0.0, runtime_overhead_gb=0.0)
#: The same total, the first half three times as wide as the second.
UNEVEN = dataclasses.replace(EVEN, name="uneven", layer_bytes=(0.3e9,) * 10 + (0.1e9,) * 10)


def twins(memory_gb: float) -> list:  # type: ignore[type-arg]
    return [make_device(n, memory_free_gb=memory_gb, speed=10.0) for n in ("a", "b")]


def own_bytes_gb(spec: ModelSpec, start: int, end: int, first: bool, last: bool) -> float:
    layers = sum(spec.layer_bytes[start:end]) if spec.layer_bytes else 0.0
    ends = (spec.embedding_params if first else 0.0) + (spec.head_params if last else 0.0)
    return (layers + ends * spec.embedding_bytes) / GB


def test_uneven_layers_move_the_cut_where_the_mean_would_not() -> None:
    devices = twins(2.4)
    even = plan(EVEN, devices)
    assert [s.layers for s in even.shards] == [10, 10]  # 2.1 GB each at the mean
    uneven = plan(UNEVEN, devices)
    assert uneven.feasible, uneven.reason
    # The first ten layers weigh 3.0 GB: the first device holds 7 (2.1 + 0.1 GB); 8 would
    # be 2.5 GB. Counted at the mean, 10 each was taken to fit.
    assert [s.layers for s in uneven.shards] == [7, 13]
    for shard in uneven.shards:
        first, last = shard.shard_index == 0, shard.shard_index == 1
        own = own_bytes_gb(UNEVEN, shard.layer_start, shard.layer_end, first, last)
        assert shard.memory_gb == round(own, 4) <= 2.4


def test_uneven_layers_that_fit_nowhere_are_refused_though_the_mean_fits() -> None:
    wide_last = dataclasses.replace(EVEN, layer_bytes=(0.1e9,) * 19 + (2.1e9,))
    devices = twins(2.15)  # the last layer (2.1 GB) and the head (0.1 GB) fit no device
    assert plan(EVEN, devices).feasible
    refused = plan(wide_last, devices)
    assert not refused.feasible and "memory" in (refused.reason or "")


def test_the_same_sizes_given_layer_by_layer_place_as_the_mean() -> None:
    spelled = dataclasses.replace(EVEN, layer_bytes=(0.2e9,) * 20)
    for memory in (1.2, 2.4, 5.0):
        devices = [
            make_device("a", memory_free_gb=memory, speed=30.0),
            make_device("b", memory_free_gb=memory * 2, speed=10.0),
            make_device("c", memory_free_gb=memory / 2, speed=20.0),
        ]
        assert previews(spelled, devices) == previews(EVEN, devices)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=4, max_size=24),
    memory=st.lists(st.floats(0.5, 4.0), min_size=1, max_size=4),
)
def test_every_shard_placed_holds_its_own_layers_bytes(
    sizes: list[int], memory: list[float]
) -> None:
    layer_bytes = tuple(s * 0.02e9 for s in sizes)
    spec = dataclasses.replace(
        EVEN,
        layers=len(sizes),
        params_per_layer=sum(layer_bytes) / len(sizes),
        layer_bytes=layer_bytes,
    )
    devices = [make_device(f"d{i}", memory_free_gb=m, speed=10.0) for i, m in enumerate(memory)]
    option = plan(spec, devices)
    if not option.feasible:
        return
    assert sum(s.layers for s in option.shards) == len(sizes)
    for shard, device in zip(option.shards, devices, strict=True):
        first, last = shard.shard_index == 0, shard.shard_index == len(devices) - 1
        own = own_bytes_gb(spec, shard.layer_start, shard.layer_end, first, last)
        assert shard.layers >= 1 and shard.memory_gb == round(own, 4)
        assert own <= device.memory_free_gb + 1e-9


@dataclass(frozen=True)
class Card:
    name: str = "mixed"
    layers: int = 4
    layer_bytes: tuple[int, ...] = (300, 100, 100, 300)
    layer_params: tuple[int, ...] = (400, 400, 400, 400)
    embedding_bytes: int = 1000
    embedding_params: int = 2000
    output_bytes: int = 50
    tied: bool = False
    kv_bytes_per_token: int = 64
    layer_type_params: Mapping[str, int] = field(default_factory=lambda: {"Q8_0": 1600})
    output_type: str = "Q8_0"


def test_a_cards_spec_keeps_each_layers_bytes_and_an_even_card_the_mean() -> None:
    spec = card_spec(Card(), "llamacpp", slots=2)
    assert spec.layer_bytes == (300, 100, 100, 300)
    kv = 64 / 4 * 2 * 10  # per layer, two slots, ten tokens
    assert spec.layers_gb(0, 1, 10) * GB == 300 + kv
    assert spec.layers_gb(1, 3, 10) * GB == 200 + 2 * kv
    overhead = spec.runtime_overhead_gb * GB
    assert spec.shard_gb(2, False, True, 10) * GB == pytest.approx(400 + 2 * kv + 50 + overhead)
    assert spec.weights_gb * GB == 800 + 1000
    assert spec.layer_types == (("Q8_0", 1.0),) and spec.output_type == "Q8_0"  # the kernels'
    even = card_spec(Card(layer_bytes=(200,) * 4), "llamacpp", slots=2)
    assert even.layer_bytes == () and even.layers_gb(1, 3, 10) * GB == pytest.approx(400 + 2 * kv)
    assert HYPOTHETICAL_MODELS["llama-3.1-8b-instruct"].layer_bytes == ()
