"""Redis connections with retry on transient errors and health checks."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def connect_redis(url: str, *, attempts: int = 10) -> Redis:
    """A client that retries a dropped connection with exponential backoff (up to ~5 s).

    The client connects lazily; call ``await client.ping()`` to fail fast at start.
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), attempts)
    return Redis.from_url(
        url,
        decode_responses=True,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError, BusyLoadingError],
        health_check_interval=15,
        socket_connect_timeout=2.0,
    )
