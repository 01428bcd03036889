"""The CLI's tables fit a terminal: `tessera devices` at 80 columns cuts no cell (it leaves
columns out, and says which), and `--wide` shows them all."""

from __future__ import annotations

import subprocess
import sys

from libs.cluster.servers import NatsServer, RedisServer
from tests.processes import ServiceProcess, service_env
from tests.waiting import wait_until_async


def devices_table(redis_url: str, prefix: str, *extra: str) -> str:
    command = [sys.executable, "-m", "libs.cli.main", "devices", "--redis-url", redis_url]
    env = {"COLUMNS": "80", "TESSERA_KEY_PREFIX": prefix, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*command, *extra], env=env, capture_output=True, text=True, check=True)
    return done.stdout


async def test_devices_at_80_columns_cut_no_cell(
    nats_server: NatsServer, redis_server: RedisServer, scorer: ServiceProcess, uid: str, redis
) -> None:
    env = service_env(nats_server, redis_server, uid, TESSERA_TELEMETRY_DEVICES="6")
    fleet = ServiceProcess("telemetry", {**env, "TESSERA_TELEMETRY_PREFIX": uid}).start()
    try:

        async def scored() -> bool:
            return await redis.zcard(f"{uid}:rank:total") == 6

        await wait_until_async(scored, timeout_s=60)
        narrow = devices_table(redis_server.url, uid)
        wide = devices_table(redis_server.url, uid, "--wide")
    finally:
        fleet.stop()
    lines = narrow.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow
    assert "…" not in narrow and "..." not in narrow, narrow
    ids = [str(d) for d in await redis.zrange(f"{uid}:rank:total", 0, -1)]
    assert len(ids) == 6
    assert all(any(line.split() and line.split()[0] == d for line in lines) for d in ids), narrow
    assert "--wide shows all" in narrow
    header = next(line for line in wide.splitlines() if "device" in line and "total" in line)
    for column in ("class", "comp", "mem", "eff", "net", "stab", "°C", "tok/s", "age s"):
        assert column in header, wide
    assert "not measured" in header, wide  # every reading of an emulated device is its class's
    assert all(
        line.rstrip().endswith("all emulated")
        for line in wide.splitlines()
        if any(line.startswith(d) for d in ids)
    ), wide
    assert "…" not in wide
