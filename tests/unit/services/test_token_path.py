"""The token path's short cuts keep what arrives: a worker's text piece written as JSON is the
chunk the model would have written, and the gateway's stream takes a chunk already queued
even when its wait has run out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from libs.contracts import TOKENS, DeviceClass, GenerationRequest, Prompt, Sampling, TokenChunk
from libs.devices.emulated import EmulatedDevice
from libs.runtime.memory_bus import MemoryBus
from services.gateway.core.deployed import Inbox, Moved
from services.gateway.core.generation import next_item
from services.worker.served.server import EngineServer
from services.worker.served.vllm_worker import VllmWorker


def no_engine(task: Any) -> EngineServer:
    raise AssertionError("no engine is started here")


async def test_a_text_piece_written_as_json_is_the_chunk_the_model_writes() -> None:
    bus = MemoryBus()
    device = EmulatedDevice.draw("w-json", DeviceClass.WORKSTATION, np.random.default_rng(0))
    worker = VllmWorker(bus, device, no_engine)
    got: list[tuple[TokenChunk, str]] = []

    async def on_chunk(chunk: TokenChunk, delivery: Any) -> None:
        got.append((chunk, delivery.subject))

    await bus.subscribe(TOKENS, on_chunk)
    request = GenerationRequest(
        request_id="req-json",
        deployment_id="dep",
        epoch=3,
        prompt_token_ids=(),
        sampling=Sampling(max_tokens=8),
        ts=time.time(),
        prompt=Prompt(kind="chat", body='{"messages": []}', fields=()),
    )
    texts = ['h\u00e9llo "x"\n', "", "\U0001f600 \\ </s>"]
    for index, text in enumerate(texts):
        await worker.streams.emit_text(request, index, text)
    await asyncio.sleep(0)
    assert len(got) == len(texts)
    for index, ((chunk, subject), text) in enumerate(zip(got, texts, strict=True)):
        expected = worker.streams.piece(request, index, text=text)
        assert chunk == expected.model_copy(update={"ts": chunk.ts})
        assert subject == TOKENS.subject(request_id="req-json", device_id=worker.device_id)
    await bus.close()


async def test_a_queued_chunk_is_taken_even_when_the_wait_has_run_out() -> None:
    queue: Inbox = asyncio.Queue()
    moved = Moved()
    queue.put_nowait(moved)
    assert await next_item(queue, 0.0) is moved
    with pytest.raises(TimeoutError):
        await next_item(queue, 0.01)
