"""The bare reference for bench/ingest.py: a plain nats-py subscriber that writes the same
hash field (the sample's JSON, keyed by the device named in the subject) to Redis with the
same pipelining (flush every 50 ms), with no validation and no scoring. Run by the benchmark
as its own process."""

from __future__ import annotations

import argparse
import asyncio
import signal

import nats
from redis.asyncio import Redis

from libs.contracts import TELEMETRY
from libs.contracts.keys import DeviceField, Keys, StatsField


async def main(nats_url: str, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    redis = Redis.from_url(redis_url, decode_responses=True)
    nc = await nats.connect(nats_url)
    buffer: list[tuple[str, bytes]] = []

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        buffer.append((msg.subject, msg.data))

    await nc.subscribe(TELEMETRY.wildcard, cb=on_message, pending_msgs_limit=1_000_000)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    while not stop.is_set():
        await asyncio.sleep(0.05)
        batch, buffer[:] = list(buffer), []
        if not batch:
            continue
        pipe = redis.pipeline(transaction=False)
        for subject, data in batch:
            pipe.hset(
                keys.device(TELEMETRY.token_of(subject, "device_id")), DeviceField.SAMPLE, data
            )
        pipe.hincrby(keys.stats, StatsField.PROCESSED, len(batch))
        await pipe.execute()
    await nc.close()
    await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--prefix", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.nats, args.redis, args.prefix))
