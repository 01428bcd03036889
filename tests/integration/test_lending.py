"""Model files lent from the device that holds them (``libs/weights/lending.py``,
``borrowing.py``), against a real nats-server with the cluster's users: a device gets a file
nobody put into the object store from the device that holds it; a lent copy cut halfway
resumes; a lender that sends other bytes is caught and the store serves; a file the store
indexes comes over several connections at once, each chunk checked, and resumes and is caught
the same way; a ticket opens one file a few times, for nobody else; a device can ask only as
itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.contracts import WEIGHTS_WANT, WeightsOffer, WeightsWant
from libs.models.gguf_info import sha256_of
from libs.runtime.nats_client import close_nats, connect_nats
from libs.weights import lending
from libs.weights.lending import TICKET_USES, Lender, lends
from libs.weights.local_files import mark_verified, read_json
from libs.weights.object_store import CHUNK_BYTES
from libs.weights.whole_files import ensure_local, publish
from tests.integration.test_weights import SIZE, Card, Steps, model_file
from tests.made_models import make_gguf

ACCESS = AccessControl(["dev-a", "dev-b", "dev-c"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = ACCESS.write_nats_config(tmp_path_factory.mktemp("nats") / "nats.conf")
    with NatsServer(config=config) as running:
        yield running


@pytest.fixture
async def devices(server: Any) -> AsyncIterator[dict[str, NatsClient]]:
    users = {d: await connect_nats(ACCESS.nats_url(server.url, d), d) for d in ACCESS.devices}
    users["admin"] = await connect_nats(ACCESS.nats_url(server.url, "admin"), "admin")
    yield users
    for nc in users.values():
        await close_nats(nc)


async def lender_of(nc: NatsClient, device: str, path: Path, sha256: str, cache: Path) -> Lender:
    """Device ``device``'s lender, holding ``path`` (noted as the model's, as ``models add``
    does on its host)."""
    mark_verified(path, sha256, cache)
    lender = Lender(nc, device, "127.0.0.1", cache_dir=cache)
    await lender.start()
    await nc.flush()
    return lender


def away(card: Card, tmp_path: Path) -> Card:
    return Card(card.name, str(tmp_path / "not-on-this-host.gguf"), card.sha256, card.size_bytes)


async def test_a_device_gets_a_file_no_store_holds_from_the_device_that_holds_it(
    devices: dict[str, NatsClient], tmp_path: Path
) -> None:
    assert lends(devices["dev-b"])  # a cluster without TLS lends
    path, card = model_file(tmp_path)
    lender = await lender_of(devices["dev-a"], "dev-a", path, card.sha256, tmp_path / "a")
    try:
        fetched = Steps()
        cache = tmp_path / "b"
        local = await ensure_local(
            devices["dev-b"], away(card, tmp_path), fetched, cache, device_id="dev-b"
        )
        assert local.read_bytes() == path.read_bytes() and local.parent == cache / "gguf"
        assert lender.lent == 1 and fetched.seen[-1] == (SIZE, SIZE)
        assert not list((cache / "gguf").glob("*.part*"))
        # B holds it now, verified: it lends it in turn (C gets it while A is gone).
    finally:
        await lender.close()
    lender_b = Lender(devices["dev-b"], "dev-b", "127.0.0.1", cache_dir=tmp_path / "b")
    await lender_b.start()
    try:
        local_c = await ensure_local(
            devices["dev-c"], away(card, tmp_path), None, tmp_path / "c", device_id="dev-c"
        )
        assert local_c.read_bytes() == path.read_bytes() and lender_b.lent == 1
    finally:
        await lender_b.close()


async def test_a_lent_copy_cut_halfway_resumes_and_a_lender_of_other_bytes_is_caught(
    devices: dict[str, NatsClient], tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    lender = await lender_of(devices["dev-a"], "dev-a", path, card.sha256, tmp_path / "a")
    cache = tmp_path / "b"
    try:
        with pytest.raises(ConnectionError):
            await ensure_local(
                devices["dev-b"], away(card, tmp_path), Steps(SIZE // 2), cache, "dev-b"
            )
        part = cache / "gguf" / f"{card.sha256}.gguf.part"
        assert SIZE // 2 <= part.stat().st_size < SIZE
        resumed = Steps()
        local = await ensure_local(devices["dev-b"], away(card, tmp_path), resumed, cache, "dev-b")
        assert local.read_bytes() == path.read_bytes()
        assert resumed.seen[0][0] > SIZE // 2  # nothing received twice
    finally:
        await lender.close()

    # A lender whose "model" is another file of the same size (its marker says otherwise):
    # the copy is refused, nothing of it is renamed into place, the store's copy is used.
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes()[::-1])
    liar = await lender_of(devices["dev-a"], "dev-a", other, card.sha256, tmp_path / "liar")
    try:
        await publish(devices["admin"], path, card.sha256)
        local_c = await ensure_local(
            devices["dev-c"], away(card, tmp_path), None, tmp_path / "c", device_id="dev-c"
        )
        assert local_c.read_bytes() == path.read_bytes() and liar.lent == 1
    finally:
        await liar.close()


async def ask_for(nc: NatsClient, device: str, card: Card) -> list[WeightsOffer]:
    return await lending.ask(nc, device, card.sha256, card.size_bytes)


def request(offer: WeightsOffer, line: str) -> bytes:
    host, _, port = offer.endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), 10) as sock:
        sock.sendall(line.encode())
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
    return out


@pytest.fixture(scope="module")
def indexed_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Card]:
    """A GGUF of ~20 MB (``publish`` puts an index of its chunks beside it) and its card."""
    folder = tmp_path_factory.mktemp("indexed")
    path = make_gguf(folder / "model.gguf", "llama", "Q8_0", layers=4, target_bytes=20_000_000)
    return path, Card("indexed", str(path), sha256_of(path), path.stat().st_size)


async def test_a_file_the_store_indexes_comes_in_stripes_each_chunk_checked(
    devices: dict[str, NatsClient],
    indexed_model: tuple[Path, Card],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, card = indexed_model
    assert await publish(devices["admin"], path, card.sha256)  # the file and its index
    size, wanted = card.size_bytes, away(card, tmp_path)
    lender = await lender_of(devices["dev-a"], "dev-a", path, card.sha256, tmp_path / "a")
    try:
        fetched = Steps()
        local = await ensure_local(devices["dev-b"], wanted, fetched, tmp_path / "b", "dev-b", 3)
        assert local.read_bytes() == path.read_bytes()
        assert lender.lent == 3 and lender.sent == size  # three stripes, nothing twice
        assert fetched.seen[-1] == (size, size)
        assert not list((tmp_path / "b" / "gguf").glob("*.part*"))

        # Cut halfway: the chunks received are kept, checked again, and not sent again.
        cache = tmp_path / "c"
        with pytest.raises(ConnectionError):
            await ensure_local(devices["dev-c"], wanted, Steps(size // 2), cache, "dev-c", 3)
        state = read_json(cache / "gguf" / f"{card.sha256}.gguf.part.json")
        held = sum(min(CHUNK_BYTES, size - i * CHUNK_BYTES) for i in state["chunks"])
        assert size // 2 <= held < size
        sent = lender.sent
        local_c = await ensure_local(devices["dev-c"], wanted, None, cache, "dev-c", 3)
        assert local_c.read_bytes() == path.read_bytes()
        assert lender.sent - sent == size - held

        # A part that holds every chunk but was never renamed (cut at the very end): nothing
        # is sent again, and it is put in place.
        part = tmp_path / "e" / "gguf" / f"{card.sha256}.gguf.part"
        part.parent.mkdir(parents=True)
        part.write_bytes(path.read_bytes())
        part.with_suffix(".part.json").write_text(
            json.dumps({"chunks": list(range(-(-size // CHUNK_BYTES)))})
        )
        sent = lender.sent
        local_e = await ensure_local(devices["dev-c"], wanted, None, tmp_path / "e", "dev-c", 3)
        assert local_e.read_bytes() == path.read_bytes() and lender.sent == sent
    finally:
        await lender.close()

    # A lender whose file differs in one byte: that chunk is caught, the copy refused and
    # deleted, and the store's copy used.
    other = tmp_path / "other.gguf"
    data = bytearray(path.read_bytes())
    data[size * 2 // 3] ^= 0xFF
    other.write_bytes(bytes(data))
    liar = await lender_of(devices["dev-a"], "dev-a", other, card.sha256, tmp_path / "liar")
    try:
        local_d = await ensure_local(devices["dev-c"], wanted, None, tmp_path / "d", "dev-c", 2)
        assert local_d.read_bytes() == path.read_bytes()
    finally:
        await liar.close()
    assert any("does not match the store's index" in r.getMessage() for r in caplog.records)


async def test_a_ticket_opens_one_file_a_few_times_and_nothing_else_opens_it(
    devices: dict[str, NatsClient], tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    lender = await lender_of(devices["dev-a"], "dev-a", path, card.sha256, tmp_path / "a")
    try:
        # A want for a file this host does not hold is not answered.
        assert await ask_for(devices["dev-b"], "dev-b", Card("x", "x", "ab" * 32, SIZE)) == []
        (offer,) = await ask_for(devices["dev-b"], "dev-b", card)
        assert offer.device_id == "dev-a"
        guessed = "0" * 32
        assert await asyncio.to_thread(request, offer, f"{guessed} 0\n") == (
            b"ERR no such ticket, or it expired or was used\n"
        )
        assert await asyncio.to_thread(request, offer, "no request\n") == (
            b"ERR expected '<ticket> <offset> [<bytes>]'\n"
        )
        tail = await asyncio.to_thread(request, offer, f"{offer.ticket} {SIZE - 10}\n")
        assert tail == b"OK 10\n" + path.read_bytes()[-10:]
        piece = await asyncio.to_thread(request, offer, f"{offer.ticket} 100 7\n")
        assert piece == b"OK 7\n" + path.read_bytes()[100:107]
        nothing = await asyncio.to_thread(request, offer, f"{offer.ticket} 100 0\n")
        assert nothing == b"OK 0\n"  # no bytes: not "to the end"
        for _ in range(TICKET_USES - 3):
            assert (await asyncio.to_thread(request, offer, f"{offer.ticket} 0 1\n"))[:2] == b"OK"
        again = await asyncio.to_thread(request, offer, f"{offer.ticket} 0\n")
        assert again.startswith(b"ERR no such ticket")
        (second,) = await ask_for(devices["dev-b"], "dev-b", card)
        past = await asyncio.to_thread(request, second, f"{second.ticket} {SIZE + 1}\n")
        assert past == f"ERR offset {SIZE + 1} is outside the file\n".encode()
        over = await asyncio.to_thread(request, second, f"{second.ticket} {SIZE - 5} 6\n")
        assert over == f"ERR 6 bytes from {SIZE - 5} run past the file's end\n".encode()
    finally:
        await lender.close()


async def test_a_device_asks_only_as_itself(server: Any, tmp_path: Path) -> None:
    """B may not publish a want as C (the lender would give C's ticket to B's inbox), nor read
    another device's offers; it does read every want (it lends too)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    device = await nats.connect(
        ACCESS.nats_url(server.url, "dev-b"), allow_reconnect=False, error_cb=on_error
    )
    try:
        as_c = WEIGHTS_WANT.subject(device_id="dev-c")
        want = WeightsWant(device_id="dev-c", sha256="ab" * 32, size_bytes=1)
        await device.publish(as_c, want.model_dump_json().encode(), reply="_INBOX_dev-b.x")
        await device.subscribe(WEIGHTS_WANT.wildcard)  # allowed: it answers wants
        await device.subscribe("_INBOX_dev-c.>")  # another device's replies
        await device.flush()
        await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(Exception):
            await device.close()
    assert any(f'publish to "{as_c}"' in e for e in errors), errors
    assert any("subscription" in e and "_inbox_dev-c" in e for e in errors), errors
    assert not any("weights.want.*" in e for e in errors), errors
