"""A replica, as one device to the policy that picks among copies: its speed stays its first
device's GFLOP/s (one unit for ``Device.speed`` everywhere), and the tokens/s its chain gives
one stream are its decode rate, so a request's seconds on it are its tokens at that rate."""

from __future__ import annotations

import numpy as np

from libs.contracts import Assignment, DeploymentState, InferenceRequest, PlacementRequest
from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.partition import step_ms
from libs.core.policies import make_policy
from services.scheduler.replicas import choose_replica, replica_device
from tests.builders import make_device

SPEC = HYPOTHETICAL_MODELS["llama-3.2-1b-instruct"]


def copy(name: str, *devices: str) -> DeploymentState:
    half = SPEC.layers // len(devices)
    return DeploymentState(
        deployment_id=name,
        model=SPEC.name,
        epoch=1,
        context_length=2048,
        assignments=tuple(
            Assignment(device_id=d, shard_index=i, layer_start=i * half, layer_end=(i + 1) * half)
            for i, d in enumerate(devices)
        ),
    )


def test_a_replica_keeps_its_first_devices_speed_and_decodes_at_its_chains_rate() -> None:
    devices = {
        "a": make_device("a", speed=500.0),
        "b": make_device("b", speed=50.0),
        "c": make_device("c", speed=400.0),
    }
    split, whole = copy("split", "a", "b"), copy("whole", "c")
    as_split = replica_device(split, devices, 1, [], 0.0, SPEC)
    as_whole = replica_device(whole, devices, 1, [], 0.0, SPEC)
    assert as_split is not None and as_whole is not None
    assert (as_split.speed, as_whole.speed) == (500.0, 400.0)  # GFLOP/s, as every device's
    rate = 1000.0 / step_ms(SPEC, [devices["a"], devices["b"]], [SPEC.layers // 2] * 2)
    assert as_split.decode_tokens_per_s == rate
    request = PlacementRequest(
        task=InferenceRequest(request_id="r", model=SPEC.name, prompt_tokens=100, max_tokens=64),
        ts=0.0,
    )
    chosen = choose_replica(
        make_policy("dwps", None), [as_split, as_whole], request, 0.0, np.random.default_rng(0)
    )
    assert chosen is not None
    seconds = {"split": 64 / rate, "whole": 64 / as_whole.decode_tokens_per_s}
    assert chosen == min(seconds.items(), key=lambda kv: kv[1])  # the one that finishes first
