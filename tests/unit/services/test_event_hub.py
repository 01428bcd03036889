"""The dashboard's event hub on the in-memory bus: events reach every browser as SSE, a slow
browser loses its oldest events (counted), and the number of browsers is bounded."""

from __future__ import annotations

import json

import fakeredis
import pytest

from libs.contracts import DEVICE_FAILED, DeviceFailed
from libs.contracts.keys import Keys
from libs.runtime.memory_bus import MemoryBus
from services.gateway.admin.events import EventHub
from services.gateway.core.errors import ApiError
from services.gateway.core.metrics import Ttfts


def hub(**limits: int) -> EventHub:
    redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    return EventHub(redis, Keys("u"), Ttfts(), **limits)  # type: ignore[arg-type]


async def events_of(stream: object, count: int) -> list[dict[str, object]]:
    out = []
    async for line in stream:  # type: ignore[attr-defined]
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
            if len(out) == count:
                return out
    return out


async def test_a_failure_on_the_bus_reaches_the_browser() -> None:
    bus, events = MemoryBus(), hub()
    await events.watch(bus)
    stream = await events.stream()
    assert await anext(stream) == ": connected\n\n"
    failed = DeviceFailed(device_id="d1", ts=10.0, last_seen_ts=7.0, missed_heartbeats=3)
    await bus.publish(DEVICE_FAILED, failed, device_id="d1")
    await bus.settle()
    [event] = await events_of(stream, 1)
    assert event["type"] == "failed" and event["device_id"] == "d1"
    await bus.close()


async def test_a_slow_browser_loses_its_oldest_events_and_browsers_are_bounded() -> None:
    events = hub(queue_size=3, max_clients=1)
    stream = await events.stream()
    await anext(stream)
    for i in range(5):
        events.push({"type": "stats", "n": i})
    assert [e["n"] for e in await events_of(stream, 3)] == [2, 3, 4]
    assert events.dropped == 2
    with pytest.raises(ApiError) as refused:
        await events.stream()
    assert refused.value.status == 429
