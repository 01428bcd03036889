"""A worker's device announces its capacity as the worker's settings make it: requests served
at once (llama.cpp's slots, vLLM's sequences, the torch ring's one) and the longest context a
request gets (vLLM's, fixed when it starts; the others size theirs to each deployment)."""

from __future__ import annotations

import pytest

from services.worker.__main__ import make_device
from services.worker.settings import WorkerSettings


@pytest.mark.parametrize(
    ("settings", "slots", "context"),
    [
        # llama.cpp sizes its cache to each deployment's context: no bound of its own.
        ({"engine": "llamacpp", "llama_slots": 3, "llama_context": 4096}, 3, None),
        ({"engine": "vllm", "max_active": 12, "vllm_context": 8192}, 12, 8192),
        ({"engine": "torch"}, 1, None),
    ],
)
def test_a_workers_device_announces_the_capacity_its_settings_give(
    settings: dict[str, object], slots: int, context: int | None
) -> None:
    worker = WorkerSettings.model_validate({"device_id": "ws-cap", **settings})
    device = make_device(worker, now=0.0)
    announce = device.announce(0.0, 1.0)
    assert (announce.slots, announce.context_length) == (slots, context)
    assert announce.engines == (settings["engine"],)
