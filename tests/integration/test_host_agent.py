"""The real host, probed and calibrated, reaches the scorer like any other device."""

from __future__ import annotations

import json
from pathlib import Path

from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts.keys import DeviceRow, Keys
from tests.processes import ServiceProcess
from tests.waiting import wait_until_async


async def test_host_agent_is_calibrated_once_and_scored(
    nats_server: NatsServer,
    redis_server: RedisServer,
    redis: Redis,
    uid: str,
    tmp_path: Path,
) -> None:
    env = {
        "TESSERA_NATS_URL": nats_server.url,
        "TESSERA_REDIS_URL": redis_server.url,
        "TESSERA_KEY_PREFIX": uid,
        "TESSERA_TELEMETRY_MODE": "host",
        "TESSERA_TELEMETRY_INTERVAL_S": "1",
        "TESSERA_TELEMETRY_CACHE_DIR": str(tmp_path),
    }
    scorer = ServiceProcess("scorer", env).start()
    host = ServiceProcess("telemetry", env).start()
    try:
        assert [e["step"] for e in host.lines if e.get("msg") == "calibrating"] == [
            "fp32 matmul",
            "int8 matmul",
            "memory copy",
            "done",
        ]
        cache = list(tmp_path.glob("calibration-*.json"))
        assert len(cache) == 1 and json.loads(cache[0].read_text())["fp32_gflops"] > 0
        keys = Keys(uid)
        rows: list[str] = []

        async def scored() -> bool:
            rows[:] = [str(k) for k in await redis.zrange(keys.rank("total"), 0, -1)]
            return bool(rows)

        await wait_until_async(scored, timeout_s=60)
        [device_id] = rows
        assert device_id.startswith("host-")
        row = DeviceRow.decode(device_id, await redis.hgetall(keys.device(device_id)))
        assert row.sample is not None and row.device_class is not None
        assert row.sample.memory_total_gb > 1 and row.sample.network_rtt_ms >= 0

        host.stop()
        second = ServiceProcess("telemetry", env).start()  # reads the cache: no calibration
        assert not [e for e in second.lines if e.get("msg") == "calibrating"]
        second.stop()
    finally:
        host.stop()
        assert scorer.stop() == 0
