"""The gateway's guards on a real gateway process: the body limit counts the bytes a client
actually sends (a chunked upload declares no length), and the request-duration histogram
covers a streamed response to its end."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.procs import free_port
from tests.processes import GATEWAY_STOPPED, ServiceProcess
from tests.waiting import wait_until_async

LIMIT = 1_048_576  #: the gateway's default body limit
CHUNK = 64 * 1024


@pytest.fixture
def gateway(nats_server: NatsServer, redis_server: RedisServer) -> Iterator[str]:
    port = free_port()
    process = ServiceProcess(
        "gateway",
        {
            "TESSERA_NATS_URL": nats_server.url,
            "TESSERA_REDIS_URL": redis_server.url,
            "TESSERA_GATEWAY_PORT": str(port),
            "TESSERA_GATEWAY_SCHEDULER_URL": f"http://127.0.0.1:{free_port()}",  # none there
            "TESSERA_GATEWAY_AUTH": "off",
        },
    ).start()
    yield f"http://127.0.0.1:{port}"
    assert process.stop() in GATEWAY_STOPPED


def test_a_chunked_10_mb_body_gets_413(gateway: str) -> None:
    def body() -> Iterator[bytes]:  # a generator: httpx sends it chunked, with no length
        for _ in range(10 * 1024 * 1024 // CHUNK):
            yield b"x" * CHUNK

    answer = httpx.post(f"{gateway}/v1/chat/completions", content=body(), timeout=60)
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"


def test_an_upload_past_the_limit_is_refused_before_it_ends(gateway: str) -> None:
    """Twice the limit sent, chunked, and the upload left open: the 413 comes back without
    the gateway waiting for a body that has not ended."""
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = f"{CHUNK:x}\r\n".encode() + b"x" * CHUNK + b"\r\n"
        for _ in range(2 * LIMIT // CHUNK):
            conn.sendall(chunk)
        # No terminating chunk: the body never ends.
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def duration(client: httpx.AsyncClient, route: str) -> tuple[float, float]:
    """(count, sum) of the request-duration histogram for ``route``."""
    text = (await client.get("/metrics")).text
    found = {"count": 0.0, "sum": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name != "tessera_gateway_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("route") == route and sample.name.endswith(("_count", "_sum")):
                found[sample.name.rsplit("_", 1)[1]] = sample.value
    return found["count"], found["sum"]


async def test_a_streamed_response_is_timed_to_its_end(gateway: str) -> None:
    route = "/v1/cluster/events"  # the dashboard's event stream: open until the client leaves
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        async with client.stream("GET", route) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            assert await anext(lines) == ": connected"
            opened = time.monotonic()
            await asyncio.sleep(1.5)  # the client holds the stream open this long
            held = time.monotonic() - opened
        timed: list[tuple[float, float]] = []

        async def observed() -> bool:  # once the gateway has seen the client leave
            timed.append(await duration(client, route))
            return timed[-1][0] >= 1

        await wait_until_async(observed, timeout_s=30)
    count, total = timed[-1]
    assert count == 1 and total >= held
