"""Shared fixtures: real nats-server and redis-server on free ports, clients, unique names."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.redis_client import connect_redis


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    client = await connect_nats(nats_server.url, "test")
    yield client
    await close_nats(client)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = connect_redis(redis_server.url)
    await client.ping()
    yield client
    await client.aclose()


@pytest.fixture
def uid() -> str:
    """A unique, subject-safe token so tests never see each other's messages or keys."""
    return "t" + uuid.uuid4().hex[:12]
