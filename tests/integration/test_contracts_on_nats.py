"""Every contract survives a trip through a real nats-server (core NATS and JetStream)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from libs.contracts import SHARD_TASK, STREAMS, TELEMETRY, ShardTask, TelemetrySample
from libs.runtime.bus import (
    Bus,
    Delivery,
    NatsBus,
    Unsubscribe,
    publish,
    subscribe,
)
from libs.runtime.memory_bus import MemoryBus
from libs.runtime.nats_client import ensure_streams
from tests.builders import make_telemetry, sample_messages
from tests.waiting import wait_until, wait_until_async


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


async def unbound(nc: NatsClient, stream: str, durable: str) -> bool:
    info = await nc.jetstream().consumer_info(stream, durable)
    return not info.push_bound


@pytest.mark.parametrize("kind", ["nats", "memory"])
async def test_a_durable_consumer_and_raw_frames_behave_alike_on_both_buses(
    kind: str, nc: NatsClient, uid: str
) -> None:
    """What the worker relies on: a durable consumer gets what was sent while it was away and
    drops what breaks the contract for good; bytes and their headers arrive as sent."""
    await ensure_streams(nc)
    bus: Bus = NatsBus(nc) if kind == "nats" else MemoryBus()
    _, task, tokens = next(s for s in sample_messages(device_id=uid) if s[0] is SHARD_TASK)
    subject = SHARD_TASK.subject(**tokens)
    taken: list[ShardTask] = []
    rejected: list[str] = []

    async def on_task(message: ShardTask, delivery: Delivery) -> None:
        taken.append(message)

    def on_rejected(channel: str, reason: str, detail: str) -> None:
        rejected.append(reason)

    async def consume() -> Unsubscribe:
        return await bus.consume(
            SHARD_TASK, on_task, durable=f"c-{uid}", subject=subject, rejected=on_rejected
        )

    await (await consume()).unsubscribe()  # the consumer exists, its process goes away
    if kind == "nats":  # the server delivers to a subscriber until it sees the interest gone
        stream = next(name for name, subjects in STREAMS.items() if SHARD_TASK.wildcard in subjects)
        await wait_until_async(lambda: unbound(nc, stream, f"c-{uid}"), timeout_s=10)
    await bus.publish_durable(SHARD_TASK, task, **tokens)
    if isinstance(bus, MemoryBus):
        bus.send_raw(subject, b"{}")
    else:
        await nc.jetstream().publish(subject, b"{}")
    sub = await consume()
    await wait_until(lambda: len(taken) == 1 and len(rejected) == 1, timeout_s=10)

    frames: list[tuple[bytes, dict[str, str] | None]] = []

    async def on_frame(delivery: Delivery) -> None:
        frames.append((delivery.data, dict(delivery.headers) if delivery.headers else None))

    raw = await bus.subscribe_bytes(f"raw.{uid}", on_frame)
    await bus.flush()
    await bus.publish_bytes(f"raw.{uid}", b"\x00\x01", {"traceparent": "x"})
    await bus.publish_bytes(f"raw.{uid}", b"\x02")
    await wait_until(lambda: len(frames) == 2, timeout_s=10)
    await sub.unsubscribe()
    await raw.unsubscribe()
    await asyncio.sleep(0.3 if kind == "nats" else 0)  # a redelivery would come within this

    assert taken == [task] and rejected == ["wrong_fields"]
    assert frames == [(b"\x00\x01", {"traceparent": "x"}), (b"\x02", None)]
