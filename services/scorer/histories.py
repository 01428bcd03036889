"""A device's uptime history in Redis (first seen, time down, failures): written with the
scorer's pipelines, read back when a device is first heard from, so a restarted scorer keeps
counting a device's stability where the last one left it; and a device's whole record read
back with its announce (``stored_records``)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from libs.contracts import DeviceAnnounce
from libs.contracts.keys import Keys
from services.scorer.table import DeviceRecord, History


def save_history(keys: Keys, record: DeviceRecord, pipe: Any) -> None:
    """Queue the record's history on ``pipe`` (stored when the pipeline executes)."""
    h = record.history
    pipe.hset(
        keys.history(record.device_id),
        mapping={
            "first_seen": h.first_seen,
            "down_s": h.down_s,
            "failures": h.failures,
            "down_since": h.down_since if h.down_since is not None else "",
        },
    )


async def load_histories(
    redis: Redis, keys: Keys, device_ids: list[str], now: float
) -> dict[str, History]:
    """Each device's stored history, or a new one that starts ``now``."""
    if not device_ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for device_id in device_ids:
        pipe.hgetall(keys.history(device_id))
    histories = {}
    for device_id, stored in zip(device_ids, await pipe.execute(), strict=True):
        down_since = stored.get("down_since") or None
        histories[device_id] = (
            History(
                first_seen=float(stored["first_seen"]),
                down_s=float(stored.get("down_s", 0.0)),
                failures=int(stored.get("failures", 0)),
                down_since=float(down_since) if down_since else None,
            )
            if stored
            else History(first_seen=now)
        )
    return histories


async def stored_records(
    redis: Redis, keys: Keys, device_ids: list[str], now: float, model_type: str
) -> dict[str, DeviceRecord]:
    """Records of devices a scorer has not heard from since it started (a restart), from the
    announces and histories Redis keeps; a device Redis holds no announce of is left out."""
    stored = await redis.mget([keys.caps(d) for d in device_ids]) if device_ids else []
    found = {d: raw for d, raw in zip(device_ids, stored, strict=True) if raw is not None}
    histories = await load_histories(redis, keys, list(found), now)
    return {
        device_id: DeviceRecord.from_announce(
            DeviceAnnounce.model_validate_json(raw), histories[device_id], now, model_type
        )
        for device_id, raw in found.items()
    }
