"""Telemetry ingest: device updates/s through NATS → scorer → Redis, against a bare pipeline.

Both consumers run as their own process against the same embedded nats-server and
redis-server and receive the same pre-encoded samples from N devices at the same offered
rate; each counts what it has written to Redis, and the rate is measured over the steady part
of the run (after a warm-up).

    python bench/ingest.py --devices 10000 --seconds 20 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import ANNOUNCE, TELEMETRY
from libs.contracts.keys import Keys
from libs.devices.fleetfile import build, mixed
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.procs import ServiceProcess
from libs.runtime.redis_client import connect_redis

ROOT = Path(__file__).resolve().parents[1]


async def drive(
    nats_url: str,
    redis_url: str,
    prefix: str,
    devices: int,
    seconds: float,
    rate: float,
    warmup_s: float,
) -> float:
    """Offer ``rate`` samples/s for ``seconds``; return the processed rate after warm-up."""
    fleet = build(mixed(devices, seed=1))
    rng = np.random.default_rng(0)
    announces = [
        (ANNOUNCE.subject(device_id=d.device_id), ANNOUNCE.encode(d.announce(time.time(), 1.0)))
        for d in fleet
    ]
    samples = [
        (TELEMETRY.subject(device_id=d.device_id), TELEMETRY.encode(d.sample(1, time.time(), rng)))
        for d in fleet
    ]
    nc = await connect_nats(nats_url, "bench")
    redis = connect_redis(redis_url)
    keys = Keys(prefix)
    for subject, data in announces:
        await nc.publish(subject, data)
    await nc.flush()
    await asyncio.sleep(1.0)
    chunk = 500
    started = time.monotonic()
    sent, index = 0, 0
    first: tuple[float, int] | None = None
    while (elapsed := time.monotonic() - started) < seconds:
        for _ in range(chunk):
            subject, data = samples[index]
            await nc.publish(subject, data)
            index = (index + 1) % len(samples)
        sent += chunk
        ahead = sent / rate - (time.monotonic() - started)
        await asyncio.sleep(max(0.0, ahead))
        if first is None and elapsed >= warmup_s:
            first = (time.monotonic(), int(await redis.hget(keys.stats, "processed") or 0))
    await nc.flush()
    end = (time.monotonic(), int(await redis.hget(keys.stats, "processed") or 0))
    await close_nats(nc)
    await redis.aclose()
    assert first is not None
    return (end[1] - first[1]) / (end[0] - first[0])


def measure(kind: str, nats: NatsServer, redis: RedisServer, args: argparse.Namespace) -> float:
    prefix = f"bench{kind}{int(time.time())}"
    env = {
        "TESSERA_NATS_URL": nats.url,
        "TESSERA_REDIS_URL": redis.url,
        "TESSERA_KEY_PREFIX": prefix,
        "TESSERA_LOG_LEVEL": "INFO" if kind == "scorer" else "WARNING",
    }
    if kind == "scorer":
        proc = ServiceProcess("scorer", env)
    else:
        bare = [str(ROOT / "bench" / "bare_ingest.py"), "--nats", nats.url, "--redis", redis.url]
        proc = ServiceProcess("bare", env, [*bare, "--prefix", prefix])
    proc.start(ready_timeout_s=60)
    try:
        return asyncio.run(
            drive(nats.url, redis.url, prefix, args.devices, args.seconds, args.rate, args.warmup)
        )
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=100_000.0, help="offered samples/s")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds not measured")
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.devices < 1 or args.seconds <= args.warmup or args.rate <= 0:
        parser.error("need --devices ≥ 1, --seconds > --warmup and a positive --rate")
    with NatsServer() as nats, RedisServer() as redis:
        scorer = measure("scorer", nats, redis, args)  # type: ignore[arg-type]
        bare = measure("bare", nats, redis, args)  # type: ignore[arg-type]
    report = {
        "devices": args.devices,
        "seconds": args.seconds,
        "offered_per_s": args.rate,
        "updates_per_s": round(scorer, 1),
        "bare_pipeline_per_s": round(bare, 1),
        "ratio": round(scorer / bare, 3),
    }
    write_report(
        args.results,
        "ingest",
        "Telemetry ingest: the scorer against a bare pipeline",
        table(report),
    )
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
