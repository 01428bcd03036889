"""A worker's durable consumer on a NATS server where no scheduler has created the streams
yet: a connection that may create the stream does (a server without accounts); a device's user,
which may not, waits for it, saying what it waits for, and takes its tasks once it exists. Neither
raises (a worker that exited would only be started into the same wait again)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.contracts import SHARD_TASK, STREAMS, ShardTask
from libs.contracts.channels import work_consumer
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams, may_administer
from tests.builders import unload_task
from tests.waiting import wait_until

ACCESS = AccessControl(["dev-a"])
STREAM = SHARD_TASK.stream


@pytest.fixture
def bare_server() -> Iterator[NatsServer]:
    """A server of its own: the session's has the streams an earlier test's scheduler made."""
    with NatsServer() as running:
        yield running  # type: ignore[misc]


@pytest.fixture
def guarded_server(tmp_path: Path) -> Iterator[NatsServer]:
    config = ACCESS.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as running:
        yield running  # type: ignore[misc]


async def test_a_consumer_on_a_server_without_accounts_creates_its_stream(
    bare_server: NatsServer,
) -> None:
    nc = await connect_nats(bare_server.url, "worker-lone")
    try:
        assert may_administer(nc)
        got: list[ShardTask] = []

        async def on_task(message: ShardTask, delivery: object) -> None:
            got.append(message)

        subject = SHARD_TASK.subject(device_id="lone")
        consumer = await asyncio.wait_for(
            NatsBus(nc).consume(SHARD_TASK, on_task, durable="worker-lone", subject=subject),
            timeout=30,
        )
        try:
            info = await nc.jetstream().stream_info(STREAM)
            assert tuple(info.config.subjects or ()) == STREAMS[STREAM]  # as the scheduler has it
            await nc.jetstream().publish(subject, SHARD_TASK.encode(unload_task("lone")))
            await wait_until(lambda: len(got) == 1, timeout_s=10)
        finally:
            await consumer.unsubscribe()
    finally:
        await close_nats(nc)


async def test_a_device_that_may_not_create_its_stream_waits_for_it_and_says_so(
    guarded_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    device = await connect_nats(ACCESS.nats_url(guarded_server.url, "dev-a"), "worker-dev-a")
    admin = await connect_nats(ACCESS.nats_url(guarded_server.url, "admin"), "admin")
    got: list[ShardTask] = []

    async def on_task(message: ShardTask, delivery: object) -> None:
        got.append(message)

    assert not may_administer(device)
    caplog.set_level(logging.INFO, logger="libs.runtime.nats_client")
    consuming = asyncio.create_task(
        NatsBus(device).consume(
            SHARD_TASK,
            on_task,
            durable=work_consumer("dev-a"),
            subject=SHARD_TASK.subject(device_id="dev-a"),
        )
    )
    try:
        said = f"waiting for the JetStream stream {STREAM}"
        await wait_until(lambda: any(said in r.getMessage() for r in caplog.records), 10)
        await asyncio.sleep(1.0)  # a while longer: it still waits, and has not raised
        assert not consuming.done()
        await ensure_streams(admin)  # the scheduler comes
        consumer = await asyncio.wait_for(consuming, timeout=30)
        try:
            assert any("stream is there" in r.getMessage() for r in caplog.records)
            await admin.jetstream().publish(
                SHARD_TASK.subject(device_id="dev-a"), SHARD_TASK.encode(unload_task("dev-a"))
            )
            await wait_until(lambda: len(got) == 1, timeout_s=10)
        finally:
            await consumer.unsubscribe()
    finally:
        consuming.cancel()
        await close_nats(device)
        await close_nats(admin)
