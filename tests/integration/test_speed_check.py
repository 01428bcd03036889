"""A device that claims 10× its real speed: the scorer (a real process, on a real nats-server and
redis-server) scores it by what it measures within a few samples, and honest devices keep their
claims."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis

from libs.contracts import ANNOUNCE, TELEMETRY, DeviceAnnounce, DeviceClass
from libs.contracts.keys import Keys
from libs.runtime.bus import publish
from tests.builders import NOW, make_capabilities, make_telemetry
from tests.processes import ServiceProcess

#: The real speed of every device here (TFLOPS) and what each achieves of it on its work.
REAL_TFLOPS = 0.2
EFFICIENCY = 0.25


async def announce(nc: NatsClient, device_id: str, claimed_factor: float) -> None:
    caps = make_capabilities(
        fp32_tflops=REAL_TFLOPS * claimed_factor,
        int8_tops=0.8 * claimed_factor,
        memory_bandwidth_gbps=20.0 * claimed_factor,
    )
    message = DeviceAnnounce(
        device_id=device_id,
        device_class=DeviceClass.LAPTOP,
        capabilities=caps,
        emulated=True,
        interval_s=1.0,
        ts=NOW,
    )
    await publish(nc, ANNOUNCE, message, device_id=device_id)


async def report(nc: NatsClient, device_id: str, seq: int, gflops: float | None) -> None:
    sample = make_telemetry(device_id, seq=seq, ts=time.time(), measured_gflops=gflops)
    await publish(nc, TELEMETRY, sample, device_id=device_id)


async def settled(redis: Redis, keys: Keys, ids: list[str], seq: int) -> dict[str, dict[str, str]]:
    """The rows once the scorer has processed every report up to ``seq`` (it counts them in
    the same pipeline that writes the scores)."""
    deadline = time.monotonic() + 10
    while int(await redis.hget(keys.stats, "processed") or 0) < len(ids) * seq:
        assert time.monotonic() < deadline, "the scorer did not process the reports"
        await asyncio.sleep(0.05)
    return {d: await redis.hgetall(keys.device(d)) for d in ids}


async def test_a_device_claiming_ten_times_its_speed_is_scored_by_what_it_measures(
    nc: NatsClient, redis: Redis, scorer: ServiceProcess, uid: str
) -> None:
    keys = Keys(uid)
    honest, other, slower, liar = (f"{uid}-{n}" for n in ("honest", "other", "slower", "liar"))
    ids = [honest, other, slower, liar]
    for device_id in ids:
        await announce(nc, device_id, 10.0 if device_id == liar else 1.0)
    real = REAL_TFLOPS * 1000 * EFFICIENCY  # GFLOP/s each achieves
    measured = dict.fromkeys(ids, real)
    measured[slower] = real / 2  # a bad day, within the tolerance: honest still
    seq = 0
    for seq in range(1, 3):  # nothing measured yet: the claims stand
        for device_id in ids:
            await report(nc, device_id, seq, None)
        scored = await settled(redis, keys, ids, seq)
    assert float(scored[liar]["compute"]) > float(scored[honest]["compute"])
    corrected_after = None
    for n in range(1, 6):
        seq += 1
        for device_id in ids:
            await report(nc, device_id, seq, measured[device_id])
        scored = await settled(redis, keys, ids, seq)
        if abs(float(scored[liar]["speed_scale"]) - 0.1) < 0.01:
            corrected_after = n
            break
    assert corrected_after is not None and corrected_after <= 3, scored[liar]
    # Its compute score is now what it would be had it told the truth: the honest device's.
    assert float(scored[liar]["compute"]) == pytest.approx(float(scored[honest]["compute"]))
    assert float(scored[honest]["speed_scale"]) == 1.0
    assert float(scored[slower]["speed_scale"]) == 1.0  # within the tolerance
    lines = [e for e in scorer.lines if e.get("msg", "").startswith("device overstates")]
    assert [e["device_id"] for e in lines] == [liar]

    # It announces the truth again: its claims stand again.
    await announce(nc, liar, 1.0)
    seq += 1
    for device_id in ids:
        await report(nc, device_id, seq, measured[device_id])
    scored = await settled(redis, keys, ids, seq)
    assert float(scored[liar]["speed_scale"]) == 1.0
    assert float(scored[liar]["compute"]) == pytest.approx(float(scored[honest]["compute"]))
