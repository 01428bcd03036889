"""The bulk of a weights fetch (``libs/weights/bulk_fetch.py``) on a second connection of the
worker's own user, against real nats-servers: over TLS where the server requires it, and
refused to a user whose grant does not read the model store."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.weights import bulk_fetch, object_store
from libs.weights.whole_files import ensure_local, publish
from tests.integration.test_weights import Card, model_file


@pytest.fixture(scope="module")
def tls_nats(pems: dict[str, Path]) -> Iterator[NatsServer]:
    with NatsServer(tls=(pems["cert"], pems["key"])) as server:
        yield server  # type: ignore[misc]


async def test_the_chunks_come_over_tls_where_the_server_requires_it(
    tls_nats: NatsServer, pems: dict[str, Path], tmp_path: Path
) -> None:
    """The server refuses plain text: the fetch works only because the bulk connection
    upgrades to TLS, trusting the CA the worker's connection trusts."""
    nc = await connect_nats(tls_nats.url, "dev-tls", ca_file=pems["ca"])
    try:
        path, card = model_file(tmp_path)
        await publish(nc, path, card.sha256)
        away = Card(card.name, str(tmp_path / "gone.gguf"), card.sha256, card.size_bytes)
        local = await ensure_local(nc, away, cache_dir=tmp_path / "cache")
        assert local.read_bytes() == path.read_bytes()
    finally:
        await close_nats(nc)


async def test_a_user_whose_grant_does_not_read_the_store_is_refused(tmp_path: Path) -> None:
    """The bulk connection logs in as the connection it is given: the gateway's user may not
    ask the model store for chunks, and gets nothing written."""
    access = AccessControl(["dev-1"])
    with NatsServer(config=access.write_nats_config(tmp_path / "nats.conf")) as server:
        admin = await connect_nats(access.nats_url(server.url, "admin"), "admin")
        gateway = await connect_nats(access.nats_url(server.url, "gateway"), "gateway")
        try:
            path, card = model_file(tmp_path)
            await publish(admin, path, card.sha256)
            info = await (await object_store.bucket(admin.jetstream())).get_info(card.sha256)
            part = tmp_path / "stolen.part"
            with open(part, "wb") as file, pytest.raises(bulk_fetch.BulkFetchError) as refused:
                await bulk_fetch.receive(
                    gateway,
                    object_store.STREAM,
                    f"$O.{object_store.BUCKET}.C.{info.nuid}",
                    1,
                    file,
                    hashlib.sha256(),
                    0,
                    card.size_bytes,
                    tmp_path / "stolen.json",
                    {},
                    None,
                    5.0,
                )
            assert "permissions violation" in str(refused.value).lower()
            assert part.stat().st_size == 0 and not (tmp_path / "stolen.json").exists()
        finally:
            await close_nats(gateway)
            await close_nats(admin)
