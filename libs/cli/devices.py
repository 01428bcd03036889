"""``tessera devices``: the fleet as the scorer sees it, best total first."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from redis.asyncio import Redis
from rich.console import Console
from rich.table import Table

from libs.contracts.keys import Keys
from libs.runtime.store import connect_redis

DIMS = ("compute", "memory", "efficiency", "network", "stability", "total")


def redis_url(explicit: str | None, run_file: Path) -> str:
    """An explicit URL, else the one `tessera up` recorded, else a clear error."""
    if explicit:
        return explicit
    if run_file.exists():
        return str(json.loads(run_file.read_text())["redis_url"])
    raise SystemExit(
        f"no running cluster found ({run_file} is missing): start one with `make up`, "
        "or pass --redis-url / set TESSERA_REDIS_URL"
    )


async def fetch(redis: Redis, keys: Keys, limit: int) -> list[tuple[str, dict[str, str]]]:
    ranked = [str(d) for d in await redis.zrevrange(keys.rank("total"), 0, limit - 1)]
    failed = sorted(str(d) for d in await redis.smembers(keys.failed))
    ids = list(ranked) + [d for d in failed if d not in ranked][: max(0, limit - len(ranked))]
    pipe = redis.pipeline(transaction=False)
    for device_id in ids:
        pipe.hgetall(keys.device(device_id))
    rows = await pipe.execute()
    return [(d, row) for d, row in zip(ids, rows, strict=True) if row]


def render(rows: list[tuple[str, dict[str, str]]], now: float) -> Table:
    table = Table(title=f"{len(rows)} devices", header_style="bold")
    for column in ("device", "class", "state", *DIMS, "temp °C", "battery", "age s"):
        table.add_column(
            column, justify="left" if column in ("device", "class", "state") else "right"
        )
    for device_id, row in rows:
        state = row.get("state", "?")
        raw = json.loads(row["raw"]) if "raw" in row else {}
        battery = raw.get("battery_percent")
        table.add_row(
            device_id,
            row.get("class", "?"),
            f"[red]{state}[/red]" if state == "failed" else state,
            *(f"{float(row[d]):.2f}" if d in row else "-" for d in DIMS),
            f"{raw['temperature_c']:.0f}" if "temperature_c" in raw else "-",
            f"{float(battery):.0f}%" if battery else "-",
            f"{now - float(row['scored_at']):.0f}" if "scored_at" in row else "-",
        )
    return table


def show_devices(url: str, prefix: str, limit: int, as_json: bool) -> None:
    async def run() -> list[tuple[str, dict[str, str]]]:
        redis = connect_redis(url)
        try:
            return await fetch(redis, Keys(prefix), limit)
        finally:
            await redis.aclose()

    rows = asyncio.run(run())
    if as_json:
        print(json.dumps([{"device_id": d, **row} for d, row in rows]))
    else:
        Console().print(render(rows, time.time()))
