"""A service's NATS and Redis connections, opened together and always closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis

from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.redis_client import connect_redis
from libs.runtime.settings import ServiceSettings


@asynccontextmanager
async def connected(
    settings: ServiceSettings, name: str
) -> AsyncIterator[tuple[NatsClient, Redis]]:
    """Connect to NATS and Redis (failing fast if Redis does not answer), then close both."""
    nc = await connect_nats(settings.nats_url, name, ca_file=settings.nats_ca)
    redis = connect_redis(settings.redis_url)
    try:
        await redis.ping()
        yield nc, redis
    finally:
        await close_nats(nc)
        await redis.aclose()
