"""Redis connections with retry on transient errors and health checks, and typed reads of the
scorer's device rows (the layout is ``libs/contracts/keys.py``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.contracts import ContractError, DeviceAnnounce
from libs.contracts.keys import DeviceRow, Keys

log = logging.getLogger(__name__)


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


async def read_devices(redis: Redis, keys: Keys, device_ids: Sequence[str]) -> list[DeviceRow]:
    """The rows of ``device_ids`` in that order, in one round trip; a missing hash is left
    out, and so is one that does not decode (logged)."""
    if not device_ids:
        return []
    pipe = redis.pipeline(transaction=False)
    for device_id in device_ids:
        pipe.hgetall(keys.device(device_id))
    rows = []
    for device_id, fields in zip(device_ids, await pipe.execute(), strict=True):
        if not fields:
            continue
        try:
            rows.append(DeviceRow.decode(device_id, fields))
        except ContractError as exc:
            log.warning("unreadable device row", extra={"device_id": device_id, "error": str(exc)})
    return rows


async def ranked_devices(redis: Redis, keys: Keys, limit: int) -> list[DeviceRow]:
    """Up to ``limit`` devices, best total first, then the failed ones."""
    ranked = [str(d) for d in await redis.zrevrange(keys.rank("total"), 0, limit - 1)]
    failed = sorted(str(d) for d in await redis.smembers(keys.failed))
    ids = ranked + [d for d in failed if d not in ranked][: max(0, limit - len(ranked))]
    return await read_devices(redis, keys, ids)


async def read_fleet(
    redis: Redis, keys: Keys, limit: int
) -> list[tuple[DeviceRow, DeviceAnnounce | None]]:
    """``ranked_devices`` with each device's announce (its limits: thermal, power, memory)."""
    rows = await ranked_devices(redis, keys, limit)
    if not rows:
        return []
    stored = await redis.mget([keys.caps(r.device_id) for r in rows])
    out = []
    for row, caps in zip(rows, stored, strict=True):
        try:
            announce = DeviceAnnounce.model_validate_json(caps) if caps else None
        except ValueError:
            announce = None
        out.append((row, announce))
    return out
