"""Hosts joining over a real nats-server: the cluster's token buys a user of the joining
device's own, a wrong or rotated-out token is refused with a clear message, and a joined
device cannot speak for another device or place work (the server refuses it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from libs.cluster.access import AccessControl
from libs.cluster.joining import JoinDesk, JoinRefused, ask_to_join, rotate_token
from libs.cluster.servers import NatsCluster, NatsServer
from libs.contracts import PLACEMENT_DECISION, TELEMETRY
from libs.runtime.nats_client import close_nats, connect_nats
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
