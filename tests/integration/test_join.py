"""Hosts joining over a real nats-server: the cluster's token buys a user of the joining
device's own, a wrong or rotated-out token is refused with a clear message, and a joined
device cannot speak for another device or place work (the server refuses it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
from nats.aio.msg import Msg

from libs.cluster.access import JOIN_USER, AccessControl, with_user
from libs.cluster.joining import JoinDesk, JoinRefused, ask_to_join, rotate_token
from libs.cluster.servers import NatsCluster, NatsServer
from libs.contracts import JOIN, PLACEMENT_DECISION, TELEMETRY
from libs.runtime.nats_client import close_nats, connect_nats, inbox_of
from tests.integration.test_access import heard


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[AccessControl, NatsServer, JoinDesk]]:
    access = AccessControl(["worker-0"])
    config = access.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as server:
        desk = JoinDesk(access, server, access.nats_url(server.url, "admin")).start()  # type: ignore[arg-type]
        yield access, server, desk  # type: ignore[misc]
        desk.close()


@pytest.fixture
async def admin(
    cluster: tuple[AccessControl, NatsServer, JoinDesk],
) -> AsyncIterator[nats.NATS]:
    access, server, _ = cluster
    nc = await nats.connect(access.nats_url(server.url, "admin"), allow_reconnect=False)
    yield nc
    await nc.close()


async def test_the_token_buys_a_user_that_speaks_only_for_its_own_device(
    cluster: tuple[AccessControl, NatsServer, JoinDesk], admin: nats.NATS
) -> None:
    access, server, desk = cluster
    url = await ask_to_join(server.url, access.token, "laptop-1")
    assert "laptop-1:" in url and access.token not in url
    assert desk.joined == ["laptop-1"]
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, allow_reconnect=False, error_cb=on_error)
    try:
        own = TELEMETRY.subject(device_id="laptop-1")
        other = TELEMETRY.subject(device_id="worker-0")
        placement = PLACEMENT_DECISION.subject(task_id="t1")
        assert await heard(admin, own, lambda: nc.publish(own, b"{}"), within_s=3)
        assert not await heard(admin, other, lambda: nc.publish(other, b"{}"))
        assert not await heard(admin, placement, lambda: nc.publish(placement, b"{}"))
        assert any("permissions violation" in e.lower() for e in errors), errors
    finally:
        await nc.close()


async def test_another_holder_of_the_token_learns_no_password_while_a_device_joins(
    cluster: tuple[AccessControl, NatsServer, JoinDesk], admin: nats.NATS
) -> None:
    """A second holder of the join token subscribes to everything its grant allows (its
    inbox, where every join answer goes) and tries the rest (the join requests, every
    subject, the old shared inbox): the server refuses those, and what it reads while
    ``laptop-1`` joins holds the answer but not the device's password; the joined device's
    own user works."""
    access, server, _ = cluster
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    spy = await nats.connect(
        with_user(server.url, JOIN_USER, access.token),
        inbox_prefix=inbox_of(JOIN_USER),
        allow_reconnect=False,
        error_cb=on_error,
    )
    read: list[bytes] = []

    async def keep(msg: Msg) -> None:
        read.append(msg.data)

    try:
        for subject in (f"{inbox_of(JOIN_USER)}.>", JOIN.subject(), ">", "_INBOX.>"):
            await spy.subscribe(subject, cb=keep)
        await spy.flush()
        url = await ask_to_join(server.url, access.token, "laptop-1")
        await spy.flush()
        await asyncio.sleep(0.5)
    finally:
        await spy.close()
    password = urlsplit(url).password
    assert password and len(password) >= 16
    assert any(b'"laptop-1"' in data for data in read), read  # it read the join answer
    assert not any(password.encode() in data for data in read), read
    refused = [e for e in errors if "permissions violation" in e.lower()]
    assert len(refused) == 3, errors  # the requests, ">" and "_INBOX.>"
    own = TELEMETRY.subject(device_id="laptop-1")
    nc = await nats.connect(url, allow_reconnect=False)
    try:
        assert await heard(admin, own, lambda: nc.publish(own, b"{}"), within_s=3)
    finally:
        await nc.close()


async def test_another_holder_of_the_token_cannot_take_over_a_joined_devices_name(
    cluster: tuple[AccessControl, NatsServer, JoinDesk], tmp_path: Path
) -> None:
    """A joined device knows the token: joining again under another device's id must not give
    it that device's user (its tasks, its frames). The host that joined as it may, after a
    restart, with the password it kept."""
    access, server, _ = cluster
    host, other = tmp_path / "host", tmp_path / "other"
    first = await ask_to_join(server.url, access.token, "laptop-1", secrets_dir=host)
    with pytest.raises(JoinRefused, match="'laptop-1' has joined already from another host"):
        await ask_to_join(server.url, access.token, "laptop-1", secrets_dir=other)
    nc = await nats.connect(first, allow_reconnect=False)  # the device's user still works
    await nc.close()
    assert await ask_to_join(server.url, access.token, "laptop-1", secrets_dir=host) == first
    assert (host / "laptop-1.secret").stat().st_mode & 0o077 == 0  # the owner's alone


async def test_a_wrong_token_and_a_service_name_are_refused_saying_why(
    cluster: tuple[AccessControl, NatsServer, JoinDesk],
) -> None:
    access, server, _ = cluster
    with pytest.raises(JoinRefused, match="refused the token: it is wrong, or it was rotated"):
        await ask_to_join(server.url, "not-the-token", "laptop-1")
    with pytest.raises(JoinRefused, match="'scheduler' is the name of a service"):
        await ask_to_join(server.url, access.token, "scheduler")
    with pytest.raises(JoinRefused, match="'worker-0' is a worker of this cluster already"):
        await ask_to_join(server.url, access.token, "worker-0")
    with pytest.raises(JoinRefused, match="no cluster answers"):
        await ask_to_join("nats://127.0.0.1:1", access.token, "laptop-1", timeout_s=2)


async def test_a_rotated_token_is_refused_and_joined_hosts_stay(
    cluster: tuple[AccessControl, NatsServer, JoinDesk],
) -> None:
    access, server, _ = cluster
    old = access.token
    joined = await ask_to_join(server.url, old, "laptop-1")
    new = await rotate_token(access.nats_url(server.url, "admin"))
    assert new != old and new == access.token
    with pytest.raises(JoinRefused, match="rotated out"):
        await ask_to_join(server.url, old, "laptop-2")
    assert "laptop-2:" in await ask_to_join(server.url, new, "laptop-2")
    still = await nats.connect(joined, allow_reconnect=False)  # the joined host's own user
    await still.close()


async def test_over_tls_a_host_joins_with_the_cluster_ca_and_is_told_to_give_it_without(
    tmp_path: Path, pems: dict[str, Path]
) -> None:
    access = AccessControl([])
    config = access.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config, tls=(pems["cert"], pems["key"])) as server:
        admin = access.nats_url(server.url, "admin")
        desk = JoinDesk(access, server, admin, ca_file=pems["ca"]).start()
        try:
            with pytest.raises(JoinRefused, match="requires TLS: give its CA with --ca"):
                await ask_to_join(server.url, access.token, "laptop-1", timeout_s=3)
            url = await ask_to_join(server.url, access.token, "laptop-1", pems["ca"])
            nc = await connect_nats(url, "joined", ca_file=pems["ca"])  # its own user, over TLS
            await close_nats(nc)
            assert await rotate_token(admin, pems["ca"]) == access.token
        finally:
            desk.close()


async def test_a_host_joins_a_nats_cluster_and_every_server_lets_it_in(tmp_path: Path) -> None:
    access = AccessControl([])
    servers = NatsCluster(3)
    servers.config = access.write_nats_config(servers.data_dir / "nats.conf")
    servers.start()
    try:
        desk = JoinDesk(access, servers, access.nats_url(servers.url, "admin")).start()
        try:
            url = await ask_to_join(servers.url, access.token, "laptop-1")
        finally:
            desk.close()
        assert url.count("laptop-1:") == 3  # one URL per server, each with its credentials
        for one in url.split(","):
            nc = await nats.connect(one, allow_reconnect=False, connect_timeout=3)
            await nc.close()
    finally:
        servers.close()
