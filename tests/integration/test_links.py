"""The link of an emulated device (``libs/cluster/links.py``): the relay adds the delay it
claims and loses or reorders nothing; a device in its namespace reaches NATS only through its
link, no faster than the link's round trip and bandwidth allow; nothing is left once it is
removed. Timings are asserted only as lower bounds (a busy machine can only add to them); the
figures themselves are printed. Namespaces are skipped, saying why, where they cannot be made."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster import links
from libs.cluster.links import LinkedHost
from libs.cluster.relay import DelayRelay
from libs.cluster.servers import NatsServer

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = links.unavailable()


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_the_relay_adds_its_delay_each_way_and_keeps_every_byte_in_order() -> None:
    server, port = await echo_server()
    relay = DelayRelay("127.0.0.1", ("127.0.0.1", port), one_way_ms=25)
    relay_port = await relay.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        trips = []
        for n in range(5):
            started = time.perf_counter()
            writer.write(f"ping {n}\n".encode())
            assert await reader.readline() == f"ping {n}\n".encode()
            trips.append((time.perf_counter() - started) * 1000)
        print(f"round trips through a 25 ms-each-way relay: {[round(t, 1) for t in trips]} ms")
        assert min(trips) >= 50.0, trips
        payload = os.urandom(4 * 1024 * 1024)  # many chunks, echoed: all back, in order
        writer.write(payload)
        back = await reader.readexactly(len(payload))
        assert back == payload
        writer.close()
    finally:
        await relay.close()
        server.close()


async def test_a_relay_whose_target_is_down_closes_the_connection() -> None:
    server, port = await echo_server()
    server.close()
    await server.wait_closed()
    relay = DelayRelay("127.0.0.1", ("127.0.0.1", port), one_way_ms=1)
    relay_port = await relay.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        assert await asyncio.wait_for(reader.read(10), 5) == b""  # closed, not hung
        writer.close()
    finally:
        await relay.close()


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        DelayRelay("127.0.0.1", ("127.0.0.1", 1), one_way_ms=-1)


PROBE = """
import asyncio, json, sys, time
import nats
async def main(url):
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
    trips = []
    for _ in range(5):
        started = time.perf_counter()
        await nc.flush()
        trips.append((time.perf_counter() - started) * 1000)
    payload = b"x" * 65536
    started = time.perf_counter()
    for _ in range(32):  # 2 MiB up the link
        await nc.publish("probe.bulk", payload)
    await nc.flush(timeout=60)
    seconds = time.perf_counter() - started
    await nc.close()
    print(json.dumps({"rtt_ms": trips, "bulk_s": seconds}))
asyncio.run(main(sys.argv[1]))
"""


REACH = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"


def run_in(link: LinkedHost, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*link.prefix(), sys.executable, "-c", code, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture
def linked(nats_server: NatsServer, uid: str) -> Iterator[LinkedHost]:
    if WHY_NOT is not None:
        pytest.skip(f"no links: {WHY_NOT}")
    host, port = nats_server.url.removeprefix("nats://").split(":")
    link = LinkedHost(uid[-6:], 0, 203, rtt_ms=20.0, mbit=16.0)
    try:
        yield link.create(f"{host}:{port}")
    finally:
        link.remove()


def test_a_device_on_a_link_reaches_nats_only_through_it_as_slow_as_it_says(
    linked: LinkedHost, nats_server: NatsServer
) -> None:
    # the head's loopback is not the device's: NATS is out of reach but through the relay
    host, port = nats_server.url.removeprefix("nats://").split(":")
    direct = run_in(linked, REACH, host, port)
    assert "ConnectionRefusedError" in direct.stderr, (direct.stdout, direct.stderr)
    done = run_in(linked, PROBE, f"nats://{linked.nats_address}")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    mbit = 2 * 1024 * 1024 * 8 / seen["bulk_s"] / 1e6
    trips = [round(t, 1) for t in seen["rtt_ms"]]
    print(f"through a 20 ms, 16 Mbit/s link: round trips {trips} ms, {mbit:.1f} Mbit/s")
    assert min(seen["rtt_ms"]) >= 20.0, seen
    # 2 MiB at 16 Mbit/s: about 1.05 s; the token bucket's few ms of burst cannot shorten it
    assert seen["bulk_s"] >= 0.9, seen


BANDWIDTH = """
import asyncio, json, sys
from libs.agents.link_probe import bandwidth_mbps
from libs.runtime.bus import NatsBus
from libs.runtime.nats_private import connected
async def main(url):  # as every connection of Tessera's: its flush follows what it sent
    nc = await connected(url, allow_reconnect=False, connect_timeout=5)
    print(json.dumps([await bandwidth_mbps(NatsBus(nc), "dev-a") for _ in range(3)]))
    await nc.close()
asyncio.run(main(sys.argv[1]))
"""


def test_a_device_measures_its_links_bandwidth_as_the_link_holds_it(linked: LinkedHost) -> None:
    """The probe a linked worker and a real host's agent use (``link_probe.bandwidth_mbps``)
    measures what ``tc`` holds the link to: no more (a busy machine can only measure less)."""
    done = run_in(linked, BANDWIDTH, f"nats://{linked.nats_address}")
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)
    print(f"bandwidth measured through a 16 Mbit/s link: {[round(m, 1) for m in measured]}")
    assert all(0 < m <= 16.0 * 1.1 for m in measured), measured  # tbf's burst: a few percent
    assert max(measured) >= 16.0 * 0.5, measured  # and not a small fraction of it


ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = server.accept()
while data := conn.recv(65536):
    conn.sendall(data)
"""


def test_the_heads_rpc_traffic_to_a_linked_device_crosses_the_links_delay(
    linked: LinkedHost,
) -> None:
    """What a split's head sends the device's llama.cpp RPC server (at ``RPC_PORT`` on the
    device's end) goes through the link's relay (``rpc_address``, which the worker
    announces): each exchange pays the link's round trip."""
    echo = subprocess.Popen(
        [*linked.prefix(), sys.executable, "-c", ECHO, linked.address, str(links.RPC_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "listening"
        host, port = linked.rpc_address.rsplit(":", 1)
        assert host == linked.head_address  # the head's end, not the device's
        with socket.create_connection((host, int(port)), 5) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            trips = []
            for _ in range(5):
                started = time.perf_counter()
                conn.sendall(b"graph")
                assert conn.recv(16) == b"graph"
                trips.append((time.perf_counter() - started) * 1000)
        print(f"RPC exchanges through a 20 ms link: {[round(t, 1) for t in trips]} ms")
        assert min(trips) >= 20.0, trips
    finally:
        echo.kill()
        echo.wait()


def test_a_removed_link_leaves_no_namespace_interface_or_relay(
    nats_server: NatsServer, uid: str
) -> None:
    if WHY_NOT is not None:
        pytest.skip(f"no links: {WHY_NOT}")
    host, port = nats_server.url.removeprefix("nats://").split(":")
    link = LinkedHost(uid[-6:], 1, 204, rtt_ms=2.0, mbit=100.0).create(f"{host}:{port}")
    relays = [link.relay, link.rpc_relay]
    sleeper = subprocess.Popen([*link.prefix(), "sleep", "300"])
    link.remove()
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    assert all(r is not None and r.poll() is not None for r in relays)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.namespace not in namespaces
    interfaces = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert link.head_end not in interfaces
