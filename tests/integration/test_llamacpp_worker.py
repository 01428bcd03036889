"""The llamacpp worker for real: llama.cpp's server and RPC servers (``make llama``) running
SmolLM2's shipped GGUF whole and split across worker processes by shard tasks over NATS."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from transformers import AutoTokenizer

from libs.cluster.servers import NatsServer
from libs.contracts import DeploymentState, GenerationRequest, Sampling, TokenChunk, shard_ring
from libs.core.catalogue import GB, card_spec
from libs.harness.workers import LocalWorkers, even_split, generate_direct, place, shard_tasks
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, gguf_path, prepare, shipped_card
from libs.runtime.bus import NatsBus
from libs.runtime.procs import free_port
from services.gateway.core.deployed import Deployed, hand_placed
from services.gateway.core.generation import GenerationClient
from services.scheduler.replicas import ENGINE_SLOTS
from services.worker.rpc.server import RpcServer
from services.worker.served.llama_server import LlamaServer
from services.worker.served.llama_worker import LAYERS, whole_task
from services.worker.settings import WorkerSettings

BINARIES = WorkerSettings().llama_bin
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not (BINARIES / ".installed").exists(),
        reason=f"no llama.cpp build in {BINARIES}: `make llama` builds it (`make test` does)",
    ),
]
DEVICES = ("lw-a", "lw-b", "lw-c", "lw-torch")
PORTS = {device: free_port() for device in DEVICES[:3]}
ENDPOINTS = tuple(f"127.0.0.1:{PORTS[d]}" for d in DEVICES[:3])
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a story about a fox who finds a key in the snow.",
)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def workers(nats_server: NatsServer) -> Iterator[LocalWorkers]:
    per_device = {
        d: {"TESSERA_WORKER_ENGINE": "llamacpp", "TESSERA_WORKER_RPC_PORT": str(PORTS[d])}
        for d in DEVICES[:3]
    }
    per_device["lw-torch"] = {"TESSERA_WORKER_ENGINE": "torch"}
    env = {"TESSERA_WORKER_LLAMA_THREADS": "1"}
    with LocalWorkers(nats_server.url, DEVICES, env=env, per_device_env=per_device) as running:
        yield running


async def deploy(
    nc: NatsClient, devices: tuple[str, ...], endpoints: tuple[str, ...]
) -> DeploymentState:
    deployment = "dep-" + uuid.uuid4().hex[:8]
    tasks = shard_tasks(
        deployment, MODEL_NAME, devices, even_split(30, len(devices)), 1, endpoints=endpoints
    )
    statuses = await place(nc, tasks, timeout_s=120)
    assert [s.state for s in statuses] == ["loaded"] * len(devices), statuses
    return hand_placed(tasks)


async def undeploy(nc: NatsClient, route: DeploymentState) -> None:
    """Every shard unloaded (the next test places the model anew on the same workers)."""
    ranges = even_split(30, len(route.route))
    tasks = shard_tasks(route.deployment_id, MODEL_NAME, route.route, ranges, 1, "unload")
    statuses = await place(nc, tasks, timeout_s=60)
    assert {s.state for s in statuses} == {"unloaded"}, statuses


async def generate(
    client: GenerationClient, route: DeploymentState, ids: list[int]
) -> list[TokenChunk]:
    request_id = uuid.uuid4().hex[:12]
    sampling = Sampling(max_tokens=NEW_TOKENS)
    return [c async for c in client.stream(route.deployment_id, request_id, ids, sampling)]


async def test_a_split_across_rpc_servers_gives_the_whole_models_greedy_tokens(
    workers: LocalWorkers, nc: NatsClient
) -> None:
    """Whole on one worker and split in 2 shards: the same greedy tokens for every prompt, one
    request at a time and all of them at once (llama-server batches them: each request's
    tokens are still its lone run's, as each has a KV cache of its own; with one shared cache
    the first token of "What is the capital of France?" flipped between "The" and "L'")."""
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book)
    routes = [
        await deploy(nc, DEVICES[:1], ENDPOINTS[:1]),
        await deploy(nc, DEVICES[1:3], ENDPOINTS[1:3]),
    ]
    for route in routes:
        book.hold(route)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    answers = {}
    for route in routes:
        sent = time.monotonic()
        runs = [await generate(client, route, ids) for ids in prompts]
        runs += await asyncio.gather(*(generate(client, route, ids) for ids in prompts))
        for text, chunks in zip(PROMPTS * 2, runs, strict=True):
            tokens = [c.token_id for c in chunks if c.token_id is not None]
            assert [c.index for c in chunks if c.token_id is not None] == list(range(len(tokens)))
            assert chunks[-1].finished and chunks[-1].completion_tokens == len(tokens), chunks[-1]
            assert chunks[-1].finish_reason in ("length", "stop")
            decoded = tokenizer.decode(tokens, skip_special_tokens=True)
            assert "".join(c.text for c in chunks) == decoded
            answers.setdefault(text, []).append(tokens)
        print(f"{route.route}: {len(runs)} streams in {time.monotonic() - sent:.2f} s")
    for text, (whole, whole_batched, split, split_batched) in answers.items():
        assert whole == split == whole_batched == split_batched, text
        assert len(whole) >= 8, text  # a real answer, not an early end
    for route in routes:
        await undeploy(nc, route)


async def test_three_shards_a_resumed_request_and_a_route_without_rpc_refused(
    workers: LocalWorkers, nc: NatsClient
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    book = Deployed()
    client = GenerationClient(NatsBus(nc), book)
    whole = await deploy(nc, DEVICES[:1], ENDPOINTS[:1])
    book.hold(whole)
    ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    want = [c.token_id for c in await generate(client, whole, ids) if c.token_id is not None]

    # Three shards, headed by lw-b (lw-a already heads the whole one, and lends its RPC server).
    route = await deploy(nc, (DEVICES[1], DEVICES[2], DEVICES[0]), (*ENDPOINTS[1:], ENDPOINTS[0]))
    book.hold(route)
    got = [c.token_id for c in await generate(client, route, ids) if c.token_id is not None]
    assert got == want

    # The owner's re-run after a migration: the head continues after the tokens it is given.
    half = len(want) // 2
    request = GenerationRequest(
        request_id=uuid.uuid4().hex[:12],
        deployment_id=route.deployment_id,
        epoch=1,
        prompt_token_ids=tuple(ids),
        generated_token_ids=tuple(want[:half]),
        sampling=Sampling(max_tokens=NEW_TOKENS),
        ts=time.time(),
    )
    rest = await generate_direct(nc, request, route.route[0], 60)
    assert [c.token_id for c in rest if c.token_id is not None] == want[half:]
    assert rest[0].index == half and rest[-1].completion_tokens == len(want)

    # A device without an RPC server in the route: no endpoints, so the llamacpp head refuses
    # with the reason instead of starting a split it cannot run.
    tasks = shard_tasks("dep-mixed", MODEL_NAME, ("lw-c", "lw-torch"), even_split(30, 2), 2)
    refused = (await place(nc, tasks[:1], timeout_s=30))[0]
    assert refused.state == "refused" and "llamacpp" in (refused.reason or ""), refused
    for done in (whole, route):
        await undeploy(nc, done)


async def test_requests_back_to_back_on_one_llama_server_all_complete() -> None:
    """llama.cpp's server drops some idle connections without a word; a request sent on one
    failed (1 to 3 in 40 here) until the worker stopped reusing them."""
    server = LlamaServer(BINARIES, gguf_path(), whole_task("ka", "ka"), LAYERS, threads=2)
    await server.start(60.0)
    try:
        failed = []
        for i in range(100):
            try:
                async for _ in server.complete([1, 2, 3, 4], Sampling(max_tokens=4), 4):
                    pass
            except Exception as exc:  # what the worker would have sent the user
                failed.append(f"{i}: {exc!r}")
            await asyncio.sleep(0.01 * (i % 5))
        assert failed == []
    finally:
        await server.stop()


async def test_a_devices_shard_takes_the_memory_the_placement_counts_for_it() -> None:
    """The scheduler counts a llamacpp shard in the GGUF's bytes and an f16 KV cache for each
    of llama-server's 8 slots: the RPC server holding layers 15..29 and the LM head grows by
    that much (its resident memory, within 10 %)."""
    rpc = RpcServer(BINARIES, "127.0.0.1", threads=1)
    await rpc.start()
    assert rpc.proc is not None
    before = resident_bytes(rpc.proc.pid)
    endpoints = ("127.0.0.1:1", rpc.endpoint)  # the head's own is not used
    shards = [("head", 0, 15), ("lender", 15, 30)]
    tasks = shard_ring("load", "mem", MODEL_NAME, shards, 1, 0.0, None, endpoints, 1024)
    server = LlamaServer(BINARIES, gguf_path(), tasks[0], LAYERS, threads=1)
    try:
        await server.start(60.0)
        grown = resident_bytes(rpc.proc.pid) - before
        spec = card_spec(shipped_card(), "llamacpp", ENGINE_SLOTS["llamacpp"])
        counted = (spec.shard_gb(15, False, True, 1024) - spec.runtime_overhead_gb) * GB
        assert abs(grown - counted) <= 0.1 * counted, (grown, counted)
    finally:
        await server.stop()
        await rpc.stop()


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
