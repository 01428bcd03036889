"""Weights progress on the cluster's event feed, against a real nats-server with the cluster's
users and a real redis-server: a torch worker on a host without the model's file fetches its
layer range from the object store, and its progress (bytes of its device, throttled) reaches
the gateway's event feed as the dashboard reads it. A device may publish only its own
progress, and only the gateway reads it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.contracts import (
    SHARD_STATUS,
    SHARD_TASK,
    WEIGHTS_PROGRESS,
    DeviceClass,
    ShardStatus,
    WeightsProgress,
    shard_ring,
)
from libs.contracts.keys import Keys
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import MODEL_NAME, gguf_path, prepare, shipped_card
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from libs.weights.whole_files import publish
from services.gateway.admin.events import EventHub
from services.gateway.core.metrics import Ttfts
from services.worker.torch.worker import TorchWorker
from tests.waiting import wait_until

ACCESS = AccessControl(["dev-1", "dev-2"])
USERS = ("admin", "dev-1", "gateway")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Any, dict[str, NatsClient]]]:
    config = ACCESS.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as server:
        users = {u: await connect_nats(ACCESS.nats_url(server.url, u), u) for u in USERS}
        try:
            yield server, users
        finally:
            for nc in users.values():
                await close_nats(nc)


async def test_a_torch_fetch_reports_its_progress_on_the_event_feed(
    cluster: tuple[Any, dict[str, NatsClient]],
    redis: Redis,
    uid: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, users = cluster
    folder = prepare()  # the converted folder first: the fetched weights go to tmp_path
    monkeypatch.setenv("TESSERA_MODEL_DIR", str(tmp_path))
    card = shipped_card().model_copy(update={"source": "/not/on/this/host.gguf"})
    await ensure_streams(users["admin"])
    await publish(users["admin"], gguf_path(), card.sha256)

    hub = EventHub(redis, Keys(uid), Ttfts())
    gateway = NatsBus(users["gateway"])
    subs = await hub.watch(gateway)
    stream = await hub.stream()
    assert await anext(stream) == ": connected\n\n"

    device = EmulatedDevice.draw("dev-1", DeviceClass.WORKSTATION, np.random.default_rng(0))
    worker = TorchWorker(NatsBus(users["dev-1"]), device, folder)
    await worker.start()
    seen: list[ShardStatus] = []

    async def on_status(status: ShardStatus, delivery: Any) -> None:
        seen.append(status)

    admin = NatsBus(users["admin"])
    watching = await admin.subscribe(SHARD_STATUS, on_status)
    half = card.layers // 2
    [task] = shard_ring("load", "dep-w", MODEL_NAME, [("dev-1", 0, half)], 1, 0.0, card=card)
    await admin.publish_durable(SHARD_TASK, task, device_id="dev-1")
    try:
        await wait_until(lambda: any(s.state in ("loaded", "failed") for s in seen), 120)
        assert [s.state for s in seen if s.state != "loading"] == ["loaded"], seen
        events = await feed(stream, "weights")
    finally:
        await worker.close()
        await watching.unsubscribe()
        for sub in subs:
            await sub.unsubscribe()

    assert {(e["device_id"], e["deployment_id"], e["model"]) for e in events} == {
        ("dev-1", "dep-w", card.name)
    }
    done = [e["bytes_done"] for e in events]
    total = events[-1]["bytes_total"]
    assert done == sorted(done) and done[-1] == total  # it ends with everything it needed
    assert 0 < total < 0.75 * card.size_bytes  # its layer range, not the file
    assert 2 <= len(events) <= 25  # throttled: every ~5 % or second, not every chunk
    print(f"{len(events)} weights events, {total} of {card.size_bytes} bytes")
    sparse = tmp_path / "gguf" / f"{card.sha256}.sparse.gguf"
    assert sparse.stat().st_blocks * 512 < 0.8 * card.size_bytes


async def feed(stream: Any, kind: str, quiet_s: float = 1.0) -> list[dict[str, Any]]:
    """The events of ``kind`` the feed sent until it has been quiet for ``quiet_s``."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(TimeoutError):
        while True:
            line = await asyncio.wait_for(anext(stream), quiet_s)
            if line.startswith("data: ") and (event := json.loads(line[6:]))["type"] == kind:
                out.append(event)
    return out


async def test_a_device_publishes_only_its_own_progress_and_only_the_gateway_reads_it(
    cluster: tuple[Any, dict[str, NatsClient]],
) -> None:
    server, users = cluster
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    device = await nats.connect(
        ACCESS.nats_url(server.url, "dev-1"), allow_reconnect=False, error_cb=on_error
    )
    own, other = (WEIGHTS_PROGRESS.subject(device_id=d) for d in ("dev-1", "dev-2"))
    got: list[str] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg.subject)

    await users["gateway"].subscribe(WEIGHTS_PROGRESS.wildcard, cb=on_msg)
    await users["gateway"].flush()
    for _ in range(20):  # the first publish after a start can go unheard (test_access.py)
        await device.publish(own, b"{}")
        await device.publish(other, b"{}")
        await users["gateway"].publish(other, b"{}")
        await device.flush()
        await users["gateway"].flush()
        if own in got:
            break
        await asyncio.sleep(0.25)
    await device.subscribe(WEIGHTS_PROGRESS.wildcard)  # another device's progress
    await device.flush()
    await asyncio.sleep(0.5)
    await device.close()
    assert own in got and other not in got
    assert any(f'publish to "{other}"' in e for e in errors), errors
    assert any("subscription" in e and "weights.progress" in e for e in errors), errors


async def test_a_dashboard_opened_while_weights_move_sees_them_at_once(
    cluster: tuple[Any, dict[str, NatsClient]], redis: Redis, uid: str
) -> None:
    _, users = cluster
    hub = EventHub(redis, Keys(uid), Ttfts())
    subs = await hub.watch(NatsBus(users["gateway"]))
    await users["gateway"].flush()  # the server holds the subscriptions before we publish
    device = NatsBus(users["dev-1"])

    async def progress(done: int) -> None:
        message = WeightsProgress(
            device_id="dev-1", model="m", deployment_id="dep-m", shard_index=0,
            bytes_done=done, bytes_total=100, ts=time.time(),
        )  # fmt: skip
        await device.publish(WEIGHTS_PROGRESS, message, device_id="dev-1")
        await device.flush()  # at the server before the hub is waited on

    async def opened() -> list[dict[str, Any]]:
        stream = await hub.stream()
        assert await anext(stream) == ": connected\n\n"
        events = await feed(stream, "weights", quiet_s=0.3)
        await stream.aclose()
        return events

    try:
        await progress(40)  # no dashboard open yet
        await wait_until(lambda: bool(hub.moving), 10)
        assert [e["bytes_done"] for e in await opened()] == [40]
        await progress(100)  # done: no bar for the next dashboard
        await wait_until(lambda: not hub.moving, 10)
        assert await opened() == []
    finally:
        for sub in subs:
            await sub.unsubscribe()
