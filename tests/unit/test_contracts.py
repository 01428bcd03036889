"""Wire models accept what is sensible and refuse nonsense with an error naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libs.contracts import (
    ALL_CHANNELS,
    MAX_MESSAGE_BYTES,
    PLACEMENT_DECISION,
    SHARD_TASK,
    TELEMETRY,
    ContractError,
    InferenceRequest,
    PlacementRequest,
)
from tests.builders import NOW, make_telemetry, sample_messages


def telemetry_json(**over: Any) -> bytes:
    data = json.loads(make_telemetry().model_dump_json())
    data.update(over)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("override", "field", "reason"),
    [
        ({"memory_available_gb": -1.0}, "memory_available_gb", "out_of_range"),
        ({"memory_total_gb": 0}, "memory_total_gb", "out_of_range"),
        ({"temperature_c": 500.0}, "temperature_c", "out_of_range"),
        ({"temperature_c": -273.0}, "temperature_c", "out_of_range"),
        ({"cpu_utilisation": 1.5}, "cpu_utilisation", "out_of_range"),
        ({"battery_percent": 101}, "battery_percent", "out_of_range"),
        ({"power_w": "lots"}, "power_w", "wrong_type"),
        ({"device_id": "a.b"}, "device_id", "out_of_range"),
        ({"device_id": "*"}, "device_id", "out_of_range"),
        ({"surprise": 1}, "surprise", "wrong_fields"),
        ({"memory_available_gb": 9.0}, "memory_available_gb", "out_of_range"),
    ],
)
def test_telemetry_rejects_nonsense_naming_the_field(
    override: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(ContractError) as caught:
        TELEMETRY.decode(telemetry_json(**override))
    assert field in caught.value.detail
    assert caught.value.reason == reason


def test_nan_and_infinity_are_refused() -> None:
    raw = telemetry_json().replace(b'"power_w": 5.0', b'"power_w": NaN')
    with pytest.raises(ContractError, match="power_w"):
        TELEMETRY.decode(raw)
    with pytest.raises(ContractError, match="power_w"):
        TELEMETRY.decode(telemetry_json().replace(b'"power_w": 5.0', b'"power_w": Infinity'))


def test_malformed_and_oversized_payloads_have_their_own_reasons() -> None:
    with pytest.raises(ContractError) as bad:
        TELEMETRY.decode(b"{not json")
    assert bad.value.reason == "malformed_json"
    with pytest.raises(ContractError) as big:
        TELEMETRY.decode(b" " * (MAX_MESSAGE_BYTES + 1))
    assert big.value.reason == "too_large"


@pytest.mark.parametrize(("channel", "message", "tokens"), sample_messages())
def test_every_channel_round_trips_in_memory(channel: Any, message: Any, tokens: Any) -> None:
    assert channel.decode(channel.encode(message)) == message
    subject = channel.subject(**tokens)
    assert subject.startswith("tessera.v1.")
    for key, value in tokens.items():
        assert channel.token_of(subject, key) == value


def test_every_channel_has_a_sample_and_a_unique_template() -> None:
    sampled = {channel.name for channel, _, _ in sample_messages()}
    assert sampled == {c.name for c in ALL_CHANNELS}
    templates = [c.template for c in ALL_CHANNELS]
    assert len(templates) == len(set(templates))


def test_subject_tokens_are_validated() -> None:
    with pytest.raises(ContractError, match="not a subject token"):
        TELEMETRY.subject(device_id="a.>")
    with pytest.raises(ContractError, match="needs tokens"):
        TELEMETRY.subject()
    assert TELEMETRY.wildcard == "tessera.v1.telemetry.*"


def test_encode_refuses_the_wrong_model() -> None:
    with pytest.raises(TypeError):
        SHARD_TASK.encode(make_telemetry())  # type: ignore[arg-type]


def test_placement_request_is_a_discriminated_union() -> None:
    raw = json.dumps(
        {
            "task": {
                "kind": "inference",
                "request_id": "r1",
                "model": "m",
                "prompt_tokens": 3,
                "max_tokens": 4,
            },
            "ts": NOW,
        }
    ).encode()
    request = PlacementRequest.model_validate_json(raw)
    assert isinstance(request.task, InferenceRequest)
    assert request.task_id == "r1"
    with pytest.raises(ValueError, match="kind"):
        PlacementRequest.model_validate_json(raw.replace(b"inference", b"teleport"))


def test_decisions_must_be_consistent() -> None:
    base = {"task_id": "x", "kind": "inference", "policy": "dwps", "mode": "balanced", "ts": NOW}
    with pytest.raises(ContractError, match="needs a reason"):
        PLACEMENT_DECISION.decode(json.dumps({**base, "placed": False}).encode())
    with pytest.raises(ContractError, match="at least one assignment"):
        PLACEMENT_DECISION.decode(json.dumps({**base, "placed": True}).encode())
