"""The embedded servers are real, isolated, and survive a restart on the same port; a
cluster home's Redis keeps what it was told across restarts and crashes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.redis_client import connect_redis
from tests.waiting import wait_until


async def test_a_value_round_trips_through_real_redis(redis: Redis, uid: str) -> None:
    await redis.hset(f"{uid}:device", mapping={"compute": "0.42", "class": "phone"})
    assert await redis.hgetall(f"{uid}:device") == {"compute": "0.42", "class": "phone"}
    info = await redis.info("server")
    assert info["redis_version"]


async def test_clients_reconnect_after_a_server_restart() -> None:
    with NatsServer() as nats_server, RedisServer() as redis_server:
        nc = await connect_nats(nats_server.url, "restart-test")
        redis = connect_redis(redis_server.url)
        await redis.set("k", "before")
        port = nats_server.port

        # Restart in a thread, as a real outage happens while the client's loop keeps running.
        await asyncio.to_thread(nats_server.restart)
        await asyncio.to_thread(redis_server.restart)
        assert nats_server.port == port

        await wait_until(lambda: nc.stats["reconnects"] >= 1 and nc.is_connected, timeout_s=10)
        await nc.flush(timeout=5)
        assert await redis.get("k") is None  # nothing kept on disk, by design
        await redis.set("k", "after")
        assert await redis.get("k") == "after"
        await close_nats(nc)
        await redis.aclose()


def test_servers_stop_and_leave_nothing_listening() -> None:
    from libs.runtime.procs import port_open

    server = NatsServer().start()
    port = server.port
    assert port_open("127.0.0.1", port)
    server.close()
    assert not port_open("127.0.0.1", port)
    assert not server.data_dir.exists()


async def test_a_client_given_several_servers_moves_to_another_when_its_own_goes() -> None:
    with NatsServer() as first, NatsServer() as second:
        nc = await connect_nats(f"{first.url}, {second.url}", "several-servers")
        servers = {first.port: first, second.port: second}
        serving = nc.connected_url.port if nc.connected_url else None
        assert serving in servers
        await asyncio.to_thread(servers[serving].kill)

        await wait_until(lambda: nc.is_connected and nc.connected_url.port != serving, 10)  # type: ignore[union-attr]
        sub = await nc.subscribe("several.echo")
        await nc.publish("several.echo", b"still here")
        assert (await sub.next_msg(timeout=5)).data == b"still here"
        await close_nats(nc)


def test_a_home_s_redis_keeps_transactions_and_survives_a_cut_tail(tmp_path: Path) -> None:
    """With the cluster's users (the default user locked, not off: a Redis that replays its
    file as a disabled default user drops every MULTI/EXEC), a registry written in
    transactions is all there after a restart, and after a crash that cut the file's tail."""
    access = AccessControl([])
    admin = f"redis://admin:{access.passwords['admin']}@127.0.0.1"
    server = RedisServer(acl=access.redis_acl(), data_dir=tmp_path)
    with server:
        client = redis.Redis.from_url(f"{admin}:{server.port}/0")
        for i in range(20):
            with client.pipeline(transaction=True) as pipe:
                pipe.set(f"card:{i}", "x" * 100)
                pipe.sadd("names", i)
                pipe.execute()
    [aof] = list((tmp_path / "appendonlydir").glob("*.incr.aof"))
    with RedisServer(port=server.port, acl=access.redis_acl(), data_dir=tmp_path):
        client = redis.Redis.from_url(f"{admin}:{server.port}/0")
        assert client.scard("names") == 20 and client.get("card:19") == b"x" * 100
    aof.write_bytes(aof.read_bytes()[:-7])  # a crash mid-write: the last transaction cut
    with RedisServer(port=server.port, acl=access.redis_acl(), data_dir=tmp_path):
        client = redis.Redis.from_url(f"{admin}:{server.port}/0")
        assert client.scard("names") == 19 and client.get("card:19") is None  # whole or not
    unauthenticated = redis.Redis(port=server.port)
    locked = pytest.raises(redis.AuthenticationError)  # the default user is locked
    with RedisServer(port=server.port, acl=access.redis_acl(), data_dir=tmp_path), locked:
        unauthenticated.get("names")


def test_a_damaged_append_only_file_is_refused_saying_how_to_mend_it(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path) as server:
        redis.Redis(port=server.port).set("k", "v")
    [aof] = list((tmp_path / "appendonlydir").glob("*.incr.aof"))
    aof.write_bytes(b"*2\r\n$3\r\nSET\r\ngarbage in the middle\r\n" + aof.read_bytes())
    before = aof.read_bytes()
    with pytest.raises(RuntimeError, match=r"append-only file .* is damaged.*redis-check-aof"):
        RedisServer(data_dir=tmp_path).start()
    assert aof.read_bytes() == before  # nothing deleted, nothing rewritten
