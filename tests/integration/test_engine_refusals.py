"""An engine of token ids (the torch ring, vLLM) refuses a request field it cannot honour by
name, which the gateway answers 400 naming it, and runs a plain chat from its token ids."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NatsClient
from transformers import AutoTokenizer

from libs.cluster.servers import NatsServer
from libs.contracts import Prompt, Sampling, TokenChunk
from libs.harness.workers import LocalWorkers, place, shard_tasks
from libs.models.chat import encode_chat
from libs.models.store import MODEL_NAME, prepare
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from services.gateway.answers import refused
from services.gateway.generation import GenerationClient, Route, RouteBook
from services.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(900)
VLLM = pytest.mark.skipif(
    not WorkerSettings().vllm_python.exists(), reason="no vLLM virtualenv: `make vllm`"
)
ENGINES = {
    "torch": {"TESSERA_WORKER_ENGINE": "torch"},
    "vllm": {"TESSERA_WORKER_ENGINE": "vllm", "OMP_NUM_THREADS": "2"},
}


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=VLLM)])
def engine(request: pytest.FixtureRequest, nats_server: NatsServer) -> Iterator[str]:
    device = f"rf-{request.param}"
    asyncio.run(streams(nats_server.url))  # as the scheduler makes them in a cluster
    with LocalWorkers(nats_server.url, [device], env=ENGINES[request.param]):
        yield request.param


async def streams(url: str) -> None:
    nc = await connect_nats(url, "test")
    try:
        await ensure_streams(nc)
    finally:
        await close_nats(nc)


async def run(
    client: GenerationClient, deployment: str, ids: list[int], prompt: Prompt
) -> list[TokenChunk]:
    sampling = Sampling(max_tokens=6)
    rid = uuid.uuid4().hex[:12]
    return [c async for c in client.stream(deployment, rid, ids, sampling, prompt)]


async def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(
    engine: str, nc: NatsClient
) -> None:
    deployment = "dep-" + uuid.uuid4().hex[:8]
    tasks = shard_tasks(deployment, MODEL_NAME, (f"rf-{engine}",), [(0, 30)], epoch=1)
    (status,) = await place(nc, tasks, timeout_s=400)
    assert status.state == "loaded", status.reason
    book = RouteBook()
    book.set(Route.of_tasks(tasks))
    client = GenerationClient(NatsBus(nc), book)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ids = encode_chat(AutoTokenizer.from_pretrained(prepare()), messages)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = json.dumps({"messages": messages, "tools": [tool]})
    [final] = await run(client, deployment, ids, Prompt(kind="chat", body=body, fields=("tools",)))
    assert final.finish_reason == "error" and final.invalid == "tools"
    error = refused(final)
    assert error.status == 400 and error.param == "tools" and engine in error.message.lower()
    plain = Prompt(kind="chat", body=json.dumps({"messages": messages}))
    chunks = await run(client, deployment, ids, plain)  # no such field: the ids run
    assert chunks[-1].finish_reason in ("stop", "length") and chunks[-1].completion_tokens
    embed = Prompt(kind="embed", body=json.dumps({"input": ["hello"]}))
    [final] = await run(client, deployment, [], embed)
    assert refused(final).status == 400 and final.invalid == "model"
