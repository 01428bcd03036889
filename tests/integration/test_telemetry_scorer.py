"""Telemetry agents → NATS → scorer → Redis, with real processes and servers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import (
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    TELEMETRY,
    DeviceAnnounce,
    DeviceClass,
)
from libs.contracts.keys import Keys
from libs.runtime.bus import subscribe
from tests.processes import TELEMETRY_INTERVAL_S, ServiceProcess, service_env
from tests.waiting import wait_until, wait_until_async

INTERVAL_S = TELEMETRY_INTERVAL_S
ALL_CLASSES = list(DeviceClass)


def write_fleet(path: Path, prefix: str, devices: dict[DeviceClass, int], seed: int) -> Path:
    spec = {"seed": seed, "prefix": prefix, "devices": {c.value: n for c, n in devices.items()}}
    path.write_text(yaml.safe_dump(spec))
    return path


async def scored(redis: Redis, keys: Keys, ids: list[str]) -> dict[str, dict[str, str]]:
    pipe = redis.pipeline(transaction=False)
    for device_id in ids:
        pipe.hgetall(keys.device(device_id))
    rows = await pipe.execute()
    return {d: row for d, row in zip(ids, rows, strict=True) if row.get("total")}


async def test_a_mixed_fleet_is_scored_ranked_and_failures_are_detected(
    nats_server: NatsServer,
    redis_server: RedisServer,
    redis: Redis,
    nc: NatsClient,
    scorer: ServiceProcess,
    uid: str,
    tmp_path: Path,
) -> None:
    keys = Keys(uid)
    # 45 devices in one fleet process, and 5 single-device agents we can kill.
    big = write_fleet(
        tmp_path / "big.yaml",
        uid,
        {c: 8 if c != DeviceClass.CLOUD_GPU else 5 for c in ALL_CLASSES},
        1,
    )
    fleet = ServiceProcess(
        "telemetry", service_env(nats_server, redis_server, uid, TESSERA_TELEMETRY_FLEET=str(big))
    )
    singles = [
        ServiceProcess(
            "telemetry",
            service_env(
                nats_server,
                redis_server,
                uid,
                TESSERA_TELEMETRY_FLEET=str(
                    write_fleet(tmp_path / f"k{i}.yaml", f"{uid}k{i}", {cls: 1}, 10 + i)
                ),
            ),
        )
        for i, cls in enumerate(ALL_CLASSES[:5])
    ]
    big_ids = [
        f"{uid}-{c.value.replace('_', '')}-{i}"
        for c in ALL_CLASSES
        for i in range(8 if c != DeviceClass.CLOUD_GPU else 5)
    ]
    single_ids = [f"{uid}k{i}-{c.value.replace('_', '')}-0" for i, c in enumerate(ALL_CLASSES[:5])]
    all_ids = big_ids + single_ids
    assert len(all_ids) == 50

    events: dict[str, list[str]] = {"failed": [], "recovered": []}
    silences: list[float] = []

    async def on_failed(event, msg: Msg) -> None:  # type: ignore[no-untyped-def]
        if event.device_id.startswith(uid):
            events["failed"].append(event.device_id)
            silences.append(event.ts - event.last_seen_ts)

    async def on_recovered(event, msg: Msg) -> None:  # type: ignore[no-untyped-def]
        if event.device_id.startswith(uid):
            events["recovered"].append(event.device_id)

    await subscribe(nc, DEVICE_FAILED, on_failed)
    await subscribe(nc, DEVICE_RECOVERED, on_recovered)

    try:
        for process in [fleet, *singles]:
            await asyncio.to_thread(process.start)
        rows: dict[str, dict[str, str]] = {}

        async def all_scored() -> bool:
            rows.update(await scored(redis, keys, all_ids))
            return len(rows) == 50

        await wait_until_async(all_scored, timeout_s=60)
        for row in rows.values():
            for dim in ("compute", "memory", "efficiency", "network", "stability", "total"):
                assert 0.0 <= float(row[dim]) <= 1.0

        def by_class(cls: DeviceClass) -> list[dict[str, str]]:
            return [r for r in rows.values() if r["class"] == cls.value]

        for ws in by_class(DeviceClass.WORKSTATION):
            for watch in by_class(DeviceClass.WATCH):
                assert float(ws["compute"]) > float(watch["compute"])
        # Efficiency follows what each device announced it delivers: FLOP/s per watt.
        announced = {
            d: DeviceAnnounce.model_validate_json(raw).capabilities
            for d, raw in zip(
                all_ids, await redis.mget([keys.caps(d) for d in all_ids]), strict=True
            )
        }
        per_watt = sorted(
            all_ids, key=lambda d: announced[d].fp32_tflops / announced[d].typical_power_w
        )
        efficiency = [float(rows[d]["efficiency"]) for d in per_watt]
        assert efficiency == sorted(efficiency)
        top = await redis.zrevrange(keys.rank("compute"), 0, 2)
        assert {rows[d]["class"] for d in top} <= {"cloud_gpu", "workstation", "edge_server"}

        # Kill the 5 single agents: failed after 3 missed heartbeats, not before.
        for process in singles:
            process.kill()
        await wait_until(lambda: len(events["failed"]) >= 5, timeout_s=60)
        assert min(silences) >= 3 * INTERVAL_S  # declared only after 3 missed heartbeats
        assert sorted(events["failed"]) == sorted(single_ids)
        assert await redis.smembers(keys.failed) == set(single_ids)
        assert (await redis.hget(keys.device(single_ids[0]), "state")) == "failed"
        assert await redis.zscore(keys.rank("total"), single_ids[0]) is None

        # Restart them: they recover.
        for process in singles:
            await asyncio.to_thread(process.start)
        await wait_until(lambda: len(events["recovered"]) >= 5, timeout_s=60)
        assert sorted(events["recovered"]) == sorted(single_ids)
        assert await redis.smembers(keys.failed) == set()
        history = await redis.hgetall(keys.history(single_ids[0]))
        assert history["failures"] == "1" and float(history["down_s"]) >= 3 * INTERVAL_S
    finally:
        for process in [fleet, *singles]:
            process.stop()


@pytest.fixture
def big_payload_nats(tmp_path: Path) -> Iterator[NatsServer]:
    config = tmp_path / "nats.conf"
    config.write_text("max_payload: 16MB\n")
    with NatsServer(config=config) as server:
        yield server  # type: ignore[misc]


async def test_garbage_and_hostile_samples_are_counted_by_reason_and_never_crash(
    big_payload_nats: NatsServer,
    redis_server: RedisServer,
    redis: Redis,
    uid: str,
) -> None:
    from libs.runtime.nats_client import close_nats, connect_nats
    from tests.builders import make_telemetry

    scorer = ServiceProcess("scorer", service_env(big_payload_nats, redis_server, uid)).start()
    nc = await connect_nats(big_payload_nats.url, "hostile")
    try:
        good = json.loads(make_telemetry("x").model_dump_json())
        sent: dict[str, int] = {}

        async def send(reason: str, payload: bytes, device_id: str = "anything") -> None:
            await nc.publish(TELEMETRY.subject(device_id=device_id), payload)
            sent[reason] = sent.get(reason, 0) + 1

        kinds = [
            ("malformed_json", lambda i: b"{" * (i % 50 + 1)),
            ("wrong_type", lambda i: json.dumps({**good, "power_w": "lots"}).encode()),
            (
                "out_of_range",
                lambda i: json.dumps({**good, "memory_available_gb": -i - 1}).encode(),
            ),
            (
                "out_of_range",
                lambda i: json.dumps(good).replace('"power_w": 5.0', '"power_w": NaN').encode(),
            ),
            ("out_of_range", lambda i: json.dumps({**good, "temperature_c": 1e6}).encode()),
            ("wrong_fields", lambda i: json.dumps({**good, "evil": "<script>"}).encode()),
            ("wrong_fields", lambda i: json.dumps({"device_id": "x"}).encode()),
            ("unknown_device", lambda i: json.dumps({**good, "device_id": f"ghost{i}"}).encode()),
        ]
        for i in range(10_000):
            reason, make = kinds[i % len(kinds)]
            await send(reason, make(i))
            if i % 500 == 0:
                await nc.flush()
        for _ in range(5):
            await send("too_large", b"x" * (10 * 1024 * 1024))
        await nc.flush()

        async def counted() -> dict[str, int]:
            stats = await redis.hgetall(Keys(uid).stats)
            return {
                k.split(":", 1)[1]: int(v) for k, v in stats.items() if k.startswith("rejected:")
            }

        deadline = time.monotonic() + 30
        while await counted() != sent and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await counted() == sent
        assert sum(sent.values()) == 10_005
        assert scorer.alive
        assert not any(e.get("level") == "error" for e in scorer.lines)
        assert await redis.keys(f"{uid}:dev:*") == []  # nothing hostile was written
    finally:
        await close_nats(nc)
        assert scorer.stop() == 0
