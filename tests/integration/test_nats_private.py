"""nats-py's private attributes, each read through ``libs/runtime/nats_private.py``, against real
nats-servers on the installed nats-py: the test to run (and mend the adapter by) before the
pinned range of nats-py in ``pyproject.toml`` is widened."""

from __future__ import annotations

import base64
import binascii
import json
import re
import sys
import tomllib
import types
from collections.abc import AsyncIterator
from importlib.metadata import version
from pathlib import Path

import nats
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from nats.aio.client import Client as NatsClient
from packaging.requirements import Requirement
from packaging.version import Version

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.runtime import nats_private
from libs.runtime.nats_client import close_nats, connect_nats, copies
from libs.weights.bulk_fetch import DirectGetReader

ROOT = Path(__file__).resolve().parents[2]
NUID = re.compile(r"[0-9A-Za-z]{22}")


def test_the_installed_nats_py_is_one_the_adapter_was_written_for() -> None:
    """The installed release is one ``WRITTEN_FOR`` names, and the pin in ``pyproject.toml``
    admits exactly those releases."""
    installed = Version(version("nats-py"))
    assert f"{installed.major}.{installed.minor}" in nats_private.WRITTEN_FOR
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"] if d.startswith("nats-py")]
    assert len(pins) == 1
    written = sorted(Version(v) for v in nats_private.WRITTEN_FOR)
    first, last = written[0], written[-1]
    for admitted in written:
        assert pins[0].specifier.contains(f"{admitted}.0")
    assert not pins[0].specifier.contains(f"{first.major}.{first.minor - 1}.99")
    assert not pins[0].specifier.contains(f"{last.major}.{last.minor + 1}.0")


async def test_a_jetstream_context_sends_on_its_connection(nc: NatsClient) -> None:
    assert nats_private.client_of(nc.jetstream()) is nc


async def test_nuids_are_fresh_and_shaped_as_the_object_stores_own(
    nc: NatsClient, uid: str
) -> None:
    """Each call gives another NUID, of the shape nats-py's object store names an object's
    chunks with on the server."""
    first, second = nats_private.next_nuid(nc), nats_private.next_nuid(nc)
    assert first != second and NUID.fullmatch(first) and NUID.fullmatch(second)
    js = nc.jetstream()
    store = await js.create_object_store(uid)
    try:
        info = await store.put("one", b"x")
        assert NUID.fullmatch(info.nuid or "")
    finally:
        await js.delete_object_store(uid)


async def test_server_info_is_what_the_connected_server_said(
    nc: NatsClient, nats_server: NatsServer
) -> None:
    info = nats_private.server_info(nc)
    assert info["port"] == nats_server.port and info["jetstream"] is True
    assert "cluster" not in info and copies(nc) == 1  # a lone server: one copy of a stream
    info["cluster"] = "changed"  # a copy: the connection's own is untouched
    assert "cluster" not in nats_private.server_info(nc)


async def test_server_info_says_where_the_server_requires_tls(pems: dict[str, Path]) -> None:
    with NatsServer(tls=(pems["cert"], pems["key"])) as server:
        nc = await connect_nats(server.url, "tls", ca_file=pems["ca"])
        try:
            assert nats_private.server_info(nc)["tls_required"] is True
        finally:
            await close_nats(nc)


async def test_a_second_connection_logs_in_with_the_users_password(tmp_path: Path) -> None:
    """The CONNECT options carry the connection's user and password: a second connection
    sending them (the weights' bulk reader) is let in as that user."""
    access = AccessControl(["dev-1"])
    with NatsServer(config=access.write_nats_config(tmp_path / "nats.conf")) as server:
        nc = await connect_nats(access.nats_url(server.url, "dev-1"), "dev-1")
        try:
            options = nats_private.connect_options(nc, None)
            assert options["user"] == "dev-1" and options["pass"] == access.passwords["dev-1"]
            DirectGetReader(nc, "OBJ_TESSERA_MODELS", 5.0).close()
        finally:
            await close_nats(nc)


class Ed25519NKey:
    """A user's nkey pair, as the ``nkeys`` package gives it to nats-py (``public_key``,
    ``sign``, ``wipe``): the public key in the nkey encoding nats-server checks (base32 of
    the user prefix, the key and its CRC-16/XMODEM, little end first). ``signed``: the
    nonces it signed, in order."""

    USER_PREFIX = 20 << 3

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self.private = private
        raw = bytes([self.USER_PREFIX]) + private.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw
        )
        raw += binascii.crc_hqx(raw, 0).to_bytes(2, "little")
        self.public_key = base64.b32encode(raw).rstrip(b"=")
        self.signed: list[str] = []

    def sign(self, data: bytes) -> bytes:
        self.signed.append(data.decode())
        return self.private.sign(data)

    def wipe(self) -> None:
        pass


@pytest.fixture
async def nkey_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[NatsClient, Ed25519NKey]]:
    """A connection as a user known by its nkey alone: the server sends a nonce, the client
    signs it (nats-py's ``_signature_cb``). The ``nkeys`` package nats-py imports for that
    is stood in for by ``Ed25519NKey`` (it is not a dependency of ours)."""
    key = Ed25519NKey(Ed25519PrivateKey.generate())

    def from_seed(seed: bytearray) -> Ed25519NKey:
        assert bytes(seed) == b"stand-in seed"
        return key

    monkeypatch.setitem(sys.modules, "nkeys", types.SimpleNamespace(from_seed=from_seed))
    users = {"authorization": {"users": [{"nkey": key.public_key.decode()}]}}
    (tmp_path / "nkeys.conf").write_text(json.dumps(users))
    with NatsServer(config=tmp_path / "nkeys.conf") as server:
        nc = await nats.connect(server.url, nkeys_seed_str="stand-in seed", allow_reconnect=False)
        try:
            yield nc, key
        finally:
            await nc.close()


async def test_a_second_connection_signs_its_own_servers_nonce(
    nkey_user: tuple[NatsClient, Ed25519NKey],
) -> None:
    """The CONNECT options carry the connection's nkey, and a signature of the nonce given
    (not of the one the first connection signed): the server lets the second connection in
    only so."""
    nc, key = nkey_user
    [own] = key.signed  # the first connection's nonce
    options = nats_private.connect_options(nc, "another nonce")
    assert options["nkey"] == key.public_key.decode() and key.signed[-1] == "another nonce"
    DirectGetReader(nc, "OBJ_TESSERA_MODELS", 5.0).close()  # refused if not signed again
    assert key.signed[-1] not in (own, "another nonce")  # the second server's own nonce


class TracedNatsServer(NatsServer):
    """A nats-server that logs every protocol line it reads, in the order it reads them."""

    def command(self) -> list[str]:
        return [*super().command(), "-DV"]


def read_order(server: TracedNatsServer, client: str) -> list[str]:
    """The SUBs and PINGs the server read from the connection named ``client``, in order."""
    lines = server.log_path.read_text(errors="replace").splitlines()
    ours = [line for line in lines if f':{client}"' in line and "<<- [" in line]
    return [line.split("<<- [", 1)[1].split()[0].rstrip("]") for line in ours]


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "nats-py-own"])
async def test_a_flush_returns_once_the_server_holds_the_subscriptions_made_before_it(
    tmp_path: Path, ordered: bool
) -> None:
    """A service says it is ready once a flush returns after it subscribed: the server must
    have read those SUBs by then. ``OrderedClient`` (every ``connect_nats`` connection) sends
    its PING after them; nats-py's own client sends it ahead of them, which is why the class
    exists (once this half fails, nats-py orders its flush itself and the class can go)."""
    with TracedNatsServer(data_dir=tmp_path) as server:
        if ordered:
            nc = await connect_nats(server.url, "flusher")
        else:
            nc = await nats.connect(server.url, name="flusher", allow_reconnect=False)
        try:
            for n in range(7):
                await nc.subscribe(f"subject.{n}")
            await nc.flush()
            read = read_order(server, "flusher")
        finally:
            await nc.close()
    last_ping = max(i for i, op in enumerate(read) if op == "PING")
    subs_before = read[:last_ping].count("SUB")
    assert subs_before == (7 if ordered else 0), read
