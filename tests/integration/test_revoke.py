"""Revoking a joined device (``tessera revoke ID``) on a real nats-server and join desk: the
server closes the device's live connection at the reload and refuses it from then on, the
cluster is told the device left (its shards move at once: the scorer declares a leaving device
failed), its work consumer is removed, and the other users go on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import NotFoundError

from libs.cluster.access import AccessControl
from libs.cluster.jetstream_grants import WORK_STREAM
from libs.cluster.joining import JoinDesk, ask_to_join, revoke_device
from libs.cluster.servers import NatsServer
from libs.contracts import DEVICE_LEAVING, SHARD_TASK, DeviceLeaving, ShardTask
from libs.contracts.channels import work_consumer
from libs.runtime.bus import NatsBus, subscribe
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from tests.waiting import wait_until


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[AccessControl, NatsServer, JoinDesk]]:
    access = AccessControl(["worker-0"])
    config = access.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as server:
        desk = JoinDesk(access, server, access.nats_url(server.url, "admin")).start()  # type: ignore[arg-type]
        yield access, server, desk  # type: ignore[misc]
        desk.close()


async def test_a_revoked_device_is_cut_off_at_once_and_its_work_moves(
    cluster: tuple[AccessControl, NatsServer, JoinDesk],
) -> None:
    access, server, desk = cluster
    admin_url = access.nats_url(server.url, "admin")
    admin = await connect_nats(admin_url, "admin")
    await ensure_streams(admin)
    left: list[DeviceLeaving] = []

    async def on_leaving(message: DeviceLeaving, msg: object) -> None:
        left.append(message)

    await subscribe(admin, DEVICE_LEAVING, on_leaving)
    url = await ask_to_join(server.url, access.token, "laptop")
    events: list[str] = []

    async def on_error(exc: Exception) -> None:
        events.append(str(exc).lower())

    async def on_disconnect() -> None:
        events.append("disconnected")

    # The device as its worker runs: its own consumer, reconnecting forever.
    device = await nats.connect(
        url,
        inbox_prefix="_INBOX_laptop",
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
    )

    async def on_task(message: ShardTask, delivery: object) -> None:
        return None

    mine = SHARD_TASK.subject(device_id="laptop")
    await NatsBus(device).consume(
        SHARD_TASK, on_task, durable=work_consumer("laptop"), subject=mine
    )
    await admin.jetstream().consumer_info(WORK_STREAM, work_consumer("laptop"))
    assert device.is_connected and events == []

    assert await revoke_device(admin_url, "laptop") == ""
    assert "disconnected" in events and not device.is_connected  # closed before the answer
    await wait_until(lambda: any("authorization violation" in e for e in events), 10)
    assert [m.device_id for m in left] == ["laptop"] and left[0].reason == "revoked"
    with pytest.raises(NotFoundError):
        await admin.jetstream().consumer_info(WORK_STREAM, work_consumer("laptop"))
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    assert "laptop" not in access.devices and desk.joined == []
    assert await revoke_device(admin_url, "laptop") == "'laptop' has no user here"
    # The rest of the cluster is untouched: a worker's user still connects.
    worker = await nats.connect(access.nats_url(server.url, "worker-0"), allow_reconnect=False)
    await worker.close()
    await device.close()
    await close_nats(admin)
