"""``tessera devices``: the fleet as the scorer sees it, best total first."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import get_args

from libs.cli.tables import Column, show
from libs.cluster import runfile
from libs.contracts import DeviceState
from libs.contracts.device import DeviceAnnounce, Reading
from libs.contracts.keys import SCORE_FIELDS, DeviceRow, Keys
from libs.runtime.redis_client import connect_redis, read_fleet


def redis_url(explicit: str | None, run_file: Path) -> str:
    """An explicit URL, else the one the running `tessera up` recorded (a file left by a
    cluster that is gone is not read), else a clear error."""
    if explicit:
        return explicit
    return str(runfile.read(run_file)["redis_url"])


#: The fleet table's columns, units in the headers; the narrower the terminal, the fewer.
COLUMNS = [
    Column("device", "left"),
    Column("class", "left", 2),
    Column("state", "left"),
    Column("total"),
    Column("comp", priority=3),
    Column("mem", priority=3),
    Column("eff", priority=3),
    Column("net", priority=4),
    Column("stab", priority=4),
    Column("°C", priority=5),
    Column("batt %", priority=6),
    Column("tok/s", priority=5),
    Column("age s", priority=7),
    Column("not measured", "left", priority=4),
]


def not_measured(announce: DeviceAnnounce | None) -> str:
    """The readings that are not measured on the device, and where each comes from
    (``libs/contracts/device.py: Source``): "all emulated" where every one is; "-" where the
    device does not say."""
    if announce is None or not announce.sources:
        return "-"
    sources = announce.sources
    if len(set(sources.values())) == 1 and len(sources) == len(get_args(Reading)):
        return f"all {next(iter(sources.values()))}".replace("all measured", "none")
    others = [f"{reading} {source}" for reading, source in sources.items() if source != "measured"]
    return ", ".join(others) or "none"


def rows_of(fleet: list[tuple[DeviceRow, DeviceAnnounce | None]], now: float) -> list[list[str]]:
    out = []
    for row, announce in fleet:
        sample = row.sample
        battery = sample.battery_percent if sample else None
        heat = sample.temperature_c if sample else None  # None: the device has no sensor
        tokens = sample.measured_tokens_per_s if sample else None
        scores = [getattr(row, name) for name in ("total", *SCORE_FIELDS[:5])]
        out.append(
            [
                row.device_id,
                row.device_class.value if row.device_class else "?",
                f"[red]{row.state}[/red]" if row.state == DeviceState.FAILED else str(row.state),
                *(f"{score:.2f}" if score is not None else "-" for score in scores),
                f"{heat:.0f}" if heat is not None else "-",
                f"{battery:.0f}" if battery is not None else "-",
                f"{tokens:.1f}" if tokens else "-",
                f"{now - row.scored_at:.0f}" if row.scored_at is not None else "-",
                not_measured(announce),
            ]
        )
    return out


def show_devices(url: str, prefix: str, limit: int, as_json: bool, wide: bool = False) -> None:
    async def run() -> list[tuple[DeviceRow, DeviceAnnounce | None]]:
        redis = connect_redis(url)
        try:
            return await read_fleet(redis, Keys(prefix), limit)
        finally:
            await redis.aclose()

    fleet = asyncio.run(run())
    if as_json:  # each row with where its readings come from
        rows = [
            row.model_dump(mode="json") | {"sources": a.sources if a else {}} for row, a in fleet
        ]
        print(json.dumps(rows))
    else:
        show(f"{len(fleet)} devices", COLUMNS, rows_of(fleet, time.time()), wide)
