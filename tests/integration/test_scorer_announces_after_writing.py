"""Write, then announce: whoever reads Redis on a scorer's SCORE, DEVICE_FAILED or
DEVICE_RECOVERED finds what the event announces (the dashboard and the scheduler read rows on
these events). A real scorer process on real servers; each event is checked the moment it
arrives, concurrently, while the scorer may still be writing the rest of its batch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.contracts import (
    ANNOUNCE,
    DEVICE_FAILED,
    DEVICE_RECOVERED,
    SCORE,
    TELEMETRY,
    DeviceAnnounce,
    DeviceClass,
    DeviceFailed,
    DeviceRecovered,
    DeviceState,
    ScoreUpdate,
)
from libs.contracts.keys import DeviceField, Keys
from libs.runtime.bus import publish, subscribe
from tests.builders import make_capabilities, make_telemetry
from tests.processes import ServiceProcess
from tests.waiting import wait_until

#: Enough devices that one flush writes a large pipeline while its events are in flight.
DEVICES = 1000
#: Announced telemetry period: a silent device fails after 3.25 s, one reported every half
#: period never does, even on a busy machine.
INTERVAL_S = 1.0
CYCLES = 3  #: failures and recoveries of every device


async def test_a_reader_on_each_scorer_event_finds_it_written(
    nc: NatsClient, redis: Redis, scorer: ServiceProcess, uid: str
) -> None:
    keys = Keys(uid)
    ids = [f"{uid}-d{i}" for i in range(DEVICES)]
    stale: list[str] = []
    seen: dict[str, Counter[str]] = {k: Counter() for k in ("score", "failed", "recovered")}
    checks: set[asyncio.Task[None]] = set()

    readers = asyncio.Semaphore(90)  # within the client's connection pool (100)

    async def row(device_id: str) -> tuple[dict[str, str], bool]:
        async with readers:
            pipe = redis.pipeline(transaction=False)
            pipe.hgetall(keys.device(device_id))
            pipe.sismember(keys.failed, device_id)
            stored, failed = await pipe.execute()
        return stored, bool(failed)

    async def check_score(update: ScoreUpdate) -> None:
        stored, _ = await row(update.device_id)
        if float(stored.get(DeviceField.SCORED_AT, 0.0)) < update.ts:
            stale.append(f"score {update.device_id}: {stored.get(DeviceField.SCORED_AT)}")
        seen["score"][update.device_id] += 1

    async def check_failed(event: DeviceFailed) -> None:
        stored, failed = await row(event.device_id)
        if stored.get(DeviceField.STATE) != DeviceState.FAILED or not failed:
            stale.append(f"failed {event.device_id}: {stored.get(DeviceField.STATE)} {failed}")
        seen["failed"][event.device_id] += 1

    async def check_recovered(event: DeviceRecovered) -> None:
        stored, failed = await row(event.device_id)
        if stored.get(DeviceField.STATE) != DeviceState.ALIVE or failed:
            stale.append(f"recovered {event.device_id}: {stored.get(DeviceField.STATE)} {failed}")
        seen["recovered"][event.device_id] += 1

    Check = Callable[[Any], Coroutine[Any, Any, None]]

    def on(check: Check) -> Callable[[Any, Msg], Awaitable[None]]:
        async def handler(event: Any, msg: Msg) -> None:
            if event.device_id.startswith(uid):  # read at once, beside the other events
                task = asyncio.create_task(check(event))
                checks.add(task)
                task.add_done_callback(checks.discard)

        return handler

    await subscribe(nc, SCORE, on(check_score))
    await subscribe(nc, DEVICE_FAILED, on(check_failed))
    await subscribe(nc, DEVICE_RECOVERED, on(check_recovered))
    await nc.flush()

    async def report_all() -> None:
        """Every device's sample in one burst (encoded first): they land in one flush, so the
        devices fail together, in one large batch."""
        now = time.time()
        burst = [
            (TELEMETRY.subject(device_id=d), TELEMETRY.encode(make_telemetry(d, ts=now)))
            for d in ids
        ]
        for subject, data in burst:
            await nc.publish(subject, data)
        await nc.flush()

    for device_id in ids:
        announce = DeviceAnnounce(
            device_id=device_id,
            device_class=DeviceClass.LAPTOP,
            capabilities=make_capabilities(),
            emulated=True,
            interval_s=INTERVAL_S,
            ts=time.time(),
        )
        await publish(nc, ANNOUNCE, announce, device_id=device_id)
    await nc.flush()

    async def keep_reporting(stop: asyncio.Event) -> None:  # heard again: every device recovers
        while not stop.is_set():
            await report_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), INTERVAL_S / 2)

    def every(kind: str, times: int) -> bool:
        return all(seen[kind][d] >= times for d in ids)

    await report_all()  # scored, then silent: every device fails
    for cycle in range(1, CYCLES + 1):  # each a chance for a reader to come too early
        await wait_until(partial(every, "failed", cycle), timeout_s=60)
        stop = asyncio.Event()
        reporting = asyncio.create_task(keep_reporting(stop))
        try:
            await wait_until(partial(every, "recovered", cycle), timeout_s=60)
            await wait_until(lambda: not checks, timeout_s=30)
        finally:
            # Silent again: the next cycle's failures. Stopped, not cancelled: nats-py 2.16
            # fails its reader when a flush is cancelled before its PONG comes.
            stop.set()
            await reporting
    assert every("score", 1)
    assert stale == []
