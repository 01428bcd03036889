"""An engine of token ids (the torch ring, vLLM) refuses a request field it cannot honour by
name, which the gateway answers 400 naming it, and runs a plain chat from its token ids: over
HTTP, through a real gateway application (in this process) to real workers on NATS."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest
from nats.aio.client import Client as NatsClient

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import DEPLOYMENTS_SNAPSHOT
from libs.deployments import DeploymentBook
from libs.harness.workers import LocalWorkers, place, shard_tasks
from libs.models.shipped import MODEL_NAME
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from libs.runtime.procs import free_port
from services.gateway.app import create_app
from services.gateway.core.deployed import hand_placed
from services.gateway.settings import GatewaySettings
from services.worker.settings import WorkerSettings
from tests.waiting import wait_until_async

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


@asynccontextmanager
async def gateway(nats_url: str, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's application with its lifespan (NATS, Redis), and a client to it."""
    settings = GatewaySettings(
        nats_url=nats_url,
        redis_url=redis_url,
        scheduler_url=f"http://127.0.0.1:{free_port()}",  # none: deployments come as snapshots
        auth="off",
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


async def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(
    engine: str, nc: NatsClient, redis_server: RedisServer, nats_server: NatsServer
) -> None:
    deployment = "dep-" + uuid.uuid4().hex[:8]
    device = f"rf-{engine}"
    tasks = shard_tasks(deployment, MODEL_NAME, (device,), [(0, 30)], epoch=1)
    (status,) = await place(nc, tasks, timeout_s=400)
    assert status.state == "loaded", status.reason
    async with gateway(nats_server.url, redis_server.url) as client:
        # What the scheduler publishes once the deployment's one shard has loaded.
        book = DeploymentBook.holding([hand_placed(tasks)], index=1, term="t1")
        await NatsBus(nc).publish(DEPLOYMENTS_SNAPSHOT, book.snapshot(time.time()))

        async def listed() -> bool:
            models = (await client.get("/v1/models")).json()["data"]
            return MODEL_NAME in [m["id"] for m in models]

        await wait_until_async(listed, 10)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        ask = {"model": deployment, "messages": messages, "max_tokens": 6}
        answer = await client.post("/v1/chat/completions", json={**ask, "tools": [tool]})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "tools" and engine in error["message"].lower()
        streamed = await client.post(
            "/v1/chat/completions", json={**ask, "tools": [tool], "stream": True}
        )
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "tools"
        plain = await client.post("/v1/chat/completions", json=ask)  # no such field: ids run
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert plain.json()["usage"]["completion_tokens"] > 0
        # Anthropic's stop_reason: a stop sequence the engine met is named as such.
        greedy = {**ask, "temperature": 0}
        said = (await client.post("/v1/chat/completions", json=greedy)).json()
        words = said["choices"][0]["message"]["content"].split()
        assert len(words) > 1, words
        anthropic = {"model": deployment, "messages": messages, "max_tokens": 6, "temperature": 0}
        anthropic["stop_sequences"] = [words[-1]]
        stopped = await client.post("/v1/messages", json=anthropic)
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["stop_reason"] == "stop_sequence"
        assert stopped.json()["stop_sequence"] == words[-1]
        embed = await client.post("/v1/embeddings", json={"model": deployment, "input": "hi"})
        assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"
