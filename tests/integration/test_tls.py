"""TLS on both entrances: a nats-server that requires it (clients must trust its CA) and the gateway
serving HTTPS while it reaches NATS over TLS. The certificates come from a throwaway CA."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.procs import free_port
from libs.weights.lending import lends
from tests.processes import GATEWAY_STOPPED, ServiceProcess


@pytest.fixture(scope="module")
def tls_nats(pems: dict[str, Path]) -> Iterator[NatsServer]:
    with NatsServer(tls=(pems["cert"], pems["key"])) as server:
        yield server  # type: ignore[misc]


async def test_nats_over_tls_with_the_ca_works_and_nothing_else_connects(
    tls_nats: NatsServer, pems: dict[str, Path]
) -> None:
    nc = await connect_nats(tls_nats.url, "tls-test", ca_file=pems["ca"])
    try:
        sub = await nc.subscribe("tls.check")
        await nc.publish("tls.check", b"over tls")
        assert (await sub.next_msg(timeout=5)).data == b"over tls"
        assert nc.connected_url is not None
        # Model files are lent in the clear: a cluster on TLS lends none (libs/weights/lending).
        assert not lends(nc)
    finally:
        await close_nats(nc)

    once = {"allow_reconnect": False, "connect_timeout": 3, "max_reconnect_attempts": 0}
    with pytest.raises(Exception, match=r"(?i)tls|ssl|secure"):  # plain text is refused
        await nats.connect(tls_nats.url, **once)
    stranger = ssl.create_default_context(cafile=None)  # system CAs: not this server's
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(tls_nats.url, tls=stranger, **once)


def test_the_gateway_serves_https_and_reaches_nats_over_tls(
    tls_nats: NatsServer, redis_server: RedisServer, pems: dict[str, Path]
) -> None:
    port = free_port()
    gateway = ServiceProcess(
        "gateway",
        {
            "TESSERA_NATS_URL": tls_nats.url,
            "TESSERA_NATS_CA": str(pems["ca"]),
            "TESSERA_REDIS_URL": redis_server.url,
            "TESSERA_GATEWAY_PORT": str(port),
            "TESSERA_GATEWAY_API_KEYS": '["sk-tls-test"]',
            "TESSERA_GATEWAY_TLS_CERTFILE": str(pems["cert"]),
            "TESSERA_GATEWAY_TLS_KEYFILE": str(pems["key"]),
        },
    ).start()
    try:
        trusted = ssl.create_default_context(cafile=str(pems["ca"]))
        health = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=trusted, timeout=10)
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "nats": True, "redis": True}
        with pytest.raises(httpx.TransportError):  # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"https://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        assert gateway.stop() in GATEWAY_STOPPED
