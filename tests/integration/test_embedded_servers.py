"""The embedded servers are real, isolated, and survive a restart on the same port."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

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
