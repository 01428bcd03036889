"""Every contract survives a trip through a real nats-server (core NATS and JetStream)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from libs.contracts import SHARD_TASK, STREAMS, TELEMETRY, TelemetrySample
from libs.runtime.bus import ensure_streams, publish, subscribe
from tests.builders import make_telemetry, sample_messages


async def test_every_channel_round_trips_through_nats(nc: NatsClient, uid: str) -> None:
    samples = sample_messages(device_id=uid, request_id=uid)
    received: list[Any] = []
    done = asyncio.Event()

    async def collect(message: Any, msg: Msg) -> None:
        received.append((msg.subject, message))
        if len(received) == len(samples):
            done.set()

    subs = []
    for channel in {id(c): c for c, _, _ in samples}.values():
        subs.append(await subscribe(nc, channel, collect))
    await nc.flush()
    for channel, message, tokens in samples:
        await publish(nc, channel, message, **tokens)
    await asyncio.wait_for(done.wait(), 5)
    for sub in subs:
        await sub.unsubscribe()

    expected = [(c.subject(**t), m) for c, m, t in samples]
    assert sorted(received, key=repr) == sorted(expected, key=repr)


async def test_shard_tasks_persist_in_jetstream_until_a_worker_pulls_them(
    nc: NatsClient, uid: str
) -> None:
    await ensure_streams(nc)
    await ensure_streams(nc)  # idempotent
    _, task, tokens = next(s for s in sample_messages(device_id=uid) if s[0] is SHARD_TASK)
    js = nc.jetstream()
    ack = await js.publish(SHARD_TASK.subject(**tokens), SHARD_TASK.encode(task))  # type: ignore[arg-type]
    assert ack.stream in STREAMS

    # A worker that starts after the publish still gets it.
    sub = await js.pull_subscribe(SHARD_TASK.subject(**tokens), durable=f"worker-{uid}")
    [msg] = await sub.fetch(1, timeout=5)
    await msg.ack()
    assert SHARD_TASK.decode(msg.data) == task


async def test_a_bad_message_is_rejected_with_the_field_named_and_the_stream_goes_on(
    nc: NatsClient, uid: str
) -> None:
    rejections: list[tuple[str, str, str]] = []
    good: list[TelemetrySample] = []
    got_good = asyncio.Event()

    async def handle(sample: TelemetrySample, msg: Msg) -> None:
        good.append(sample)
        got_good.set()

    sub = await subscribe(
        nc,
        TELEMETRY,
        handle,
        rejected=lambda *r: rejections.append(r),
        subject=TELEMETRY.subject(device_id=uid),
    )
    await nc.flush()
    bad = (
        make_telemetry(uid)
        .model_dump_json()
        .replace('"memory_available_gb":4.0', '"memory_available_gb":-2')
    )
    assert '"memory_available_gb":-2' in bad
    await nc.publish(TELEMETRY.subject(device_id=uid), bad.encode())
    await nc.publish(TELEMETRY.subject(device_id=uid), b"\x00garbage")
    await publish(nc, TELEMETRY, make_telemetry(uid), device_id=uid)
    await asyncio.wait_for(got_good.wait(), 5)
    await sub.unsubscribe()

    assert good == [make_telemetry(uid)]
    assert [(c, r) for c, r, _ in rejections] == [
        ("telemetry", "out_of_range"),
        ("telemetry", "malformed_json"),
    ]
    assert "memory_available_gb" in rejections[0][2]


@pytest.mark.parametrize("size", [2 * 1024 * 1024])
async def test_the_server_refuses_oversized_payloads(nc: NatsClient, size: int) -> None:
    from nats.errors import MaxPayloadError

    with pytest.raises(MaxPayloadError):
        await nc.publish("tessera-test.big", b"x" * size)
