"""A host on the same LAN with no credentials (a third network namespace) gets nothing from the
cluster's servers: nats-server, with the users `tessera up --listen` writes, refuses a
connection without a user, with a made-up one and with a device's name and a wrong password;
Redis, which `tessera up` binds to loopback, cannot even be reached from another host, and were
it bound on the LAN, its users (the default user off) answer nothing without a password.
llama.cpp's RPC port is the RPC channel's test (tests/integration/test_rpc_channel.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer, RedisServer
from libs.harness.lan import UNAVAILABLE, Lan, lan

pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")

ACCESS = AccessControl(["dev-a"])

#: Run on the outsider's host: each way in, and what it got.
PROBE = """
import asyncio, json, socket, sys
import nats, redis

nats_url, redis_host, redis_port, loopback_redis_port = sys.argv[1:5]

async def nats_as(url):
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                                connect_timeout=3)
    except Exception as exc:
        return "refused: " + str(exc)[:200]
    await nc.close()
    return "connected"

def redis_ping(host, port, password=None):
    try:
        client = redis.Redis(host=host, port=int(port), password=password, socket_timeout=3,
                             socket_connect_timeout=3)
        client.ping()
        return "pong: " + json.dumps(client.keys("*")[:3], default=str)
    except Exception as exc:
        return "refused: " + type(exc).__name__ + " " + str(exc)[:200]

host_port = nats_url.split("//", 1)[1]
print(json.dumps({
    "nats_no_user": asyncio.run(nats_as(nats_url)),
    "nats_made_up_user": asyncio.run(nats_as(f"nats://mallory:guess@{host_port}")),
    "nats_device_wrong_password": asyncio.run(nats_as(f"nats://dev-a:guess@{host_port}")),
    "redis_no_user": redis_ping(redis_host, redis_port),
    "redis_default_password": redis_ping(redis_host, redis_port, "guess"),
    "redis_on_loopback_from_another_host": redis_ping(redis_host, loopback_redis_port),
}))
"""


@pytest.fixture(scope="module")
def network() -> Iterator[Lan]:
    with lan(1) as made:
        yield made


def test_a_host_without_credentials_gets_nothing_from_nats_or_redis(
    network: Lan, tmp_path: Path
) -> None:
    nats = NatsServer(config=ACCESS.write_nats_config(tmp_path / "nats.conf"))
    nats.host = network.address  # as `tessera up --listen ADDRESS` runs it
    exposed = RedisServer(acl=ACCESS.redis_acl())
    exposed.host = network.address  # the worst case: Redis bound on the LAN
    loopback = RedisServer(acl=ACCESS.redis_acl())  # as `tessera up` runs it
    outsider = network.hosts[0]
    with nats, exposed, loopback:
        done = subprocess.run(
            [
                *outsider.prefix,
                sys.executable,
                "-c",
                PROBE,
                f"nats://{network.address}:{nats.port}",
                network.address,
                str(exposed.port),
                str(loopback.port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        print(f"from the outsider: {seen}")
        for way in ("nats_no_user", "nats_made_up_user", "nats_device_wrong_password"):
            assert "authorization violation" in seen[way].lower(), seen
        assert "NOAUTH" in seen["redis_no_user"] or "Authentication" in seen["redis_no_user"]
        assert seen["redis_default_password"].startswith("refused"), seen
        assert "ConnectionError" in seen["redis_on_loopback_from_another_host"], seen
        # The cluster's own users still get in, from this host.
        own = ACCESS.nats_url(nats.url, "dev-a")
        ok = subprocess.run(
            [sys.executable, "-c", PROBE, own, "127.0.0.1", "1", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(ok.stdout)["nats_no_user"] == "connected", ok.stdout
