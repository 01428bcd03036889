"""The CPU shard worker for real: SmolLM2 split across worker processes over a real nats-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NatsClient
from transformers import AutoTokenizer

from libs.cluster.servers import NatsServer
from libs.contracts import GENERATION, Sampling, TokenChunk
from libs.harness.workers import LocalWorkers, even_split, place, shard_tasks
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.bus import NatsBus, subscribe
from services.gateway.core.deployed import Deployed, hand_placed
from services.gateway.core.generation import GenerationClient
from services.worker.torch.shard import ShardModel, greedy
from tests.ties import assert_same_or_near_tie
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

DEVICES = ("pw-a", "pw-b", "pw-c", "pw-doomed", "pw-phone")
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
)


@pytest.fixture(scope="module")
def workers(nats_server: NatsServer) -> Iterator[LocalWorkers]:
    phone = {
        "TESSERA_WORKER_DEVICE_CLASS": "phone",
        "TESSERA_WORKER_MEMORY_GB": "0.1",
    }  # int8 whole: 135 MB
    with LocalWorkers(
        nats_server.url,
        DEVICES,
        env={"TESSERA_WORKER_SPEED_FACTOR": "1.0"},
        per_device_env={"pw-phone": phone},
    ) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(prepare())


def prompt_ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


async def deploy(nc: NatsClient, devices: tuple[str, ...], book: Deployed, epoch: int = 1) -> str:
    deployment = "dep-" + uuid.uuid4().hex[:8]
    tasks = shard_tasks(deployment, MODEL_NAME, devices, even_split(30, len(devices)), epoch)
    assert [s.state for s in await place(nc, tasks)] == ["loaded"] * len(devices)
    book.hold(hand_placed(tasks))
    return deployment


async def collect(client: GenerationClient, deployment: str, ids: list[int], **kw: object):  # type: ignore[no-untyped-def]
    chunks: list[TokenChunk] = []
    async for chunk in client.stream(deployment, uuid.uuid4().hex[:12], ids, Sampling(**kw)):
        chunks.append(chunk)
    return chunks


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [c.token_id for c in chunks if c.token_id is not None]


async def test_split_pipelines_produce_the_whole_models_greedy_tokens(
    workers: LocalWorkers, nc: NatsClient, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    """Two- and three-shard pipelines across processes give exactly the tokens of the same
    model (the workers' default precision, int8) run whole in this process."""
    reference = ShardModel(prepare(), 0, 30)
    stop = {tokenizer.eos_token_id}
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book)
    placements = [("pw-a",), ("pw-a", "pw-b"), ("pw-a", "pw-b", "pw-c")]
    deployments = [await deploy(nc, p, book) for p in placements]
    for text in PROMPTS:
        ids = prompt_ids(tokenizer, text)
        expected = greedy(reference, ids, 24, stop)
        runs = [await collect(client, d, ids, max_tokens=24) for d in deployments]
        for placement, chunks in zip(placements, runs, strict=True):
            assert tokens(chunks) == expected, f"{len(placement)} shard(s) differ on {text!r}"
            assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
            assert "".join(c.text for c in chunks) == tokenizer.decode(expected, True)
            assert [c.index for c in chunks[:-1]] == list(range(len(expected)))


async def test_killing_a_shard_worker_mid_stream_completes_the_request_once(
    workers: LocalWorkers, nc: NatsClient, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book, stall_s=30)
    ids = prompt_ids(tokenizer, "Write a long story about a lighthouse keeper.")
    whole = await deploy(nc, ("pw-c",), book)
    expected = tokens(await collect(client, whole, ids, max_tokens=40))
    assert len(expected) == 40

    deployment = await deploy(nc, ("pw-a", "pw-doomed"), book)
    chunks: list[TokenChunk] = []
    async for chunk in client.stream(
        deployment, "kill-" + uuid.uuid4().hex[:6], ids, Sampling(max_tokens=40)
    ):
        chunks.append(chunk)
        if len(chunks) == 8:
            workers.workers["pw-doomed"].kill()
            # What the scheduler does on the failure: the whole model on a live device, epoch 2.
            tasks = shard_tasks(deployment, MODEL_NAME, ("pw-b",), [(0, 30)], epoch=2)
            await place(nc, tasks)
            book.hold(hand_placed(tasks))
    # Resumed after the failure, the tokens streamed so far are prefilled as one chunk where the
    # first run decoded them one by one: equal, or parted at a near tie (tests/ties.py).
    assert_same_or_near_tie(ShardModel(prepare(), 0, 30), ids, tokens(chunks), expected)
    assert [c.index for c in chunks[:-1]] == list(range(40))  # each token once, in order
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 40
    assert {c.epoch for c in chunks[:8]} == {1} and chunks[-1].epoch == 2


async def test_a_phone_refuses_a_shard_larger_than_its_memory(
    workers: LocalWorkers, nc: NatsClient
) -> None:
    tasks = shard_tasks("dep-" + uuid.uuid4().hex[:8], MODEL_NAME, ("pw-phone",), [(0, 30)], 1)
    (status,) = await place(nc, tasks)
    assert status.state == "refused"
    assert "does not fit phone pw-phone" in (status.reason or "")
    small = shard_tasks("dep-" + uuid.uuid4().hex[:8], MODEL_NAME, ("pw-phone",), [(10, 12)], 1)
    small = [t.model_copy(update={"route": ()}) for t in small]
    (status,) = await place(nc, small)
    assert status.state == "loaded"


async def test_sampling_is_reproducible_and_a_stop_string_ends_the_stream(
    workers: LocalWorkers, nc: NatsClient, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book)
    deployment = await deploy(nc, ("pw-b", "pw-c"), book)
    ids = prompt_ids(tokenizer, "Tell me about cats.")
    kw = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    one, two = [await collect(client, deployment, ids, **kw) for _ in range(2)]
    assert tokens(one) == tokens(two)
    greedy = "".join(c.text for c in await collect(client, deployment, ids, max_tokens=30))
    stop = greedy.split()[3]
    stopped = await collect(client, deployment, ids, max_tokens=30, stop=(stop,))
    text = "".join(c.text for c in stopped)
    assert stopped[-1].finish_reason == "stop"
    assert stop not in text and greedy.startswith(text)


async def test_a_request_for_a_shard_still_loading_waits_and_a_cancel_stops_it(
    workers: LocalWorkers, nc: NatsClient, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book)
    deployment = "dep-" + uuid.uuid4().hex[:8]
    tasks = shard_tasks(deployment, MODEL_NAME, ("pw-a",), [(0, 30)], 1)
    book.hold(hand_placed(tasks))
    ids = prompt_ids(tokenizer, "Count to one hundred.")
    received: list[TokenChunk] = []

    async def read() -> None:  # sent before the shard exists: parked, then run
        async for chunk in client.stream(
            deployment, "park-" + uuid.uuid4().hex[:6], ids, Sampling(max_tokens=500)
        ):
            received.append(chunk)
            if len(received) == 5:
                break  # the user goes away: the client cancels

    arrived = asyncio.Event()

    async def on_request(request: object, msg: object) -> None:
        arrived.set()

    subject = GENERATION.subject(deployment_id=deployment, device_id="pw-a")
    watch = await subscribe(nc, GENERATION, on_request, subject=subject)
    reader = asyncio.create_task(read())
    await asyncio.wait_for(arrived.wait(), 30)  # the request is out before the shard exists
    await watch.unsubscribe()
    await place(nc, tasks)
    await asyncio.wait_for(reader, 60)
    assert len(received) == 5
    worker = workers.workers["pw-a"]
    await wait_until(lambda: any(e.get("msg") == "cancelled" for e in worker.lines), 30)
