"""Weights through the cluster's JetStream object store, against a real nats-server: a file put
once is fetched whole on a host that lacks it, a host that has it uses its own, a fetch cut
halfway resumes where it stopped, and a corrupt copy is refused, never renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.weights import object_store
from libs.weights.object_store import CHUNK_BYTES, WeightsError
from libs.weights.whole_files import ensure_local, publish

SIZE = 40 * CHUNK_BYTES + 12345  # more chunks than one write takes, and a short last one


@dataclass(frozen=True)
class Card:
    """The fields of a model card that weights delivery reads."""

    name: str
    source: str
    sha256: str
    size_bytes: int


def model_file(folder: Path, size: int = SIZE) -> tuple[Path, Card]:
    """A file of random bytes (weights delivery reads no GGUF structure) and its card."""
    path = folder / "model.gguf"
    path.write_bytes(os.urandom(size))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, Card("test-model", str(path), sha, size)


@pytest.fixture
async def clean_bucket(nc: NatsClient) -> None:
    """Every test starts with no TESSERA_MODELS bucket (the server is shared by the session)."""
    js = nc.jetstream()
    with contextlib.suppress(Exception):  # absent is what we want
        await js.delete_object_store(object_store.BUCKET)


class Steps:
    """A progress callback that records (bytes, total) and can stop the transfer at a byte."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.seen: list[tuple[int, int]] = []
        self.stop_at = stop_at

    def __call__(self, done: int, total: int) -> None:
        self.seen.append((done, total))
        if self.stop_at is not None and done >= self.stop_at:
            raise ConnectionError("cut halfway")


async def test_a_host_without_the_file_fetches_it_from_the_bucket_once(
    nc: NatsClient, clean_bucket: None, tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    sent = Steps()
    assert await publish(nc, path, card.sha256, sent) is True
    assert sent.seen[-1] == (SIZE, SIZE)
    assert await publish(nc, path, card.sha256) is False  # there already: nothing sent again

    elsewhere = Card(card.name, str(tmp_path / "not-on-this-host.gguf"), card.sha256, SIZE)
    cache = tmp_path / "host-b-cache"
    fetched = Steps()
    local = await ensure_local(nc, elsewhere, fetched, cache_dir=cache)
    assert local == cache / "gguf" / f"{card.sha256}.gguf"
    assert local.read_bytes() == path.read_bytes()
    assert fetched.seen[-1] == (SIZE, SIZE) and len(fetched.seen) >= 6
    assert not list((cache / "gguf").glob("*.part*"))
    # Fetched once: the next call finds the verified copy and asks the bucket nothing.
    assert await ensure_local(None, elsewhere, cache_dir=cache) == local


async def test_a_host_that_holds_the_file_uses_its_own_and_a_changed_one_is_not_trusted(
    nc: NatsClient, clean_bucket: None, tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    await publish(nc, path, card.sha256)
    cache = tmp_path / "cache"
    assert await ensure_local(None, card, cache_dir=cache) == path
    assert (cache / "gguf" / "verified" / f"{card.sha256}.json").exists()
    assert not (cache / "gguf" / f"{card.sha256}.gguf").exists()
    original = path.read_bytes()
    path.write_bytes(original[::-1])  # same size, other bytes
    local = await ensure_local(nc, card, cache_dir=cache)
    assert local != path and local.read_bytes() == original


async def test_a_host_whose_cache_cannot_be_written_still_uses_its_own_file(
    tmp_path: Path,
) -> None:
    # A container's model folder belongs to root and the worker runs as another user (root
    # here writes anywhere, so the cache is put under a file: its folders cannot be made).
    path, card = model_file(tmp_path)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    assert await ensure_local(None, card, cache_dir=blocked) == path


async def test_a_fetch_cut_halfway_resumes_where_it_stopped(
    nc: NatsClient, clean_bucket: None, tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    await publish(nc, path, card.sha256)
    away = Card(card.name, str(tmp_path / "gone.gguf"), card.sha256, SIZE)
    cache = tmp_path / "cache"
    with pytest.raises(ConnectionError):
        await ensure_local(nc, away, Steps(stop_at=SIZE // 2), cache_dir=cache)
    part = cache / "gguf" / f"{card.sha256}.gguf.part"
    assert SIZE // 2 <= part.stat().st_size < SIZE
    resumed = Steps()
    local = await ensure_local(nc, away, resumed, cache_dir=cache)
    assert local.read_bytes() == path.read_bytes()
    # The first chunk it received lies past the half already fetched: nothing fetched twice.
    assert resumed.seen[0][0] > SIZE // 2
    assert not part.exists()


async def test_a_corrupt_copy_is_refused_and_nothing_is_renamed_into_place(
    nc: NatsClient, clean_bucket: None, tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    await publish(nc, path, card.sha256)
    away = Card(card.name, str(tmp_path / "gone.gguf"), card.sha256, SIZE)
    cache = tmp_path / "cache"
    with pytest.raises(ConnectionError):
        await ensure_local(nc, away, Steps(stop_at=SIZE // 2), cache_dir=cache)
    part = cache / "gguf" / f"{card.sha256}.gguf.part"
    with open(part, "r+b") as file:  # a bit flipped on disk while the fetch was away
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(WeightsError, match="does not hash to"):
        await ensure_local(nc, away, cache_dir=cache)
    assert not (cache / "gguf" / f"{card.sha256}.gguf").exists() and not part.exists()
    # The next try fetches it whole again.
    assert (await ensure_local(nc, away, cache_dir=cache)).read_bytes() == path.read_bytes()


async def test_what_is_not_there_is_said_plainly(
    nc: NatsClient, clean_bucket: None, tmp_path: Path
) -> None:
    path, card = model_file(tmp_path)
    away = Card(card.name, str(tmp_path / "gone.gguf"), card.sha256, SIZE)
    with pytest.raises(WeightsError, match="no TESSERA_MODELS bucket"):
        await ensure_local(nc, away, cache_dir=tmp_path / "cache")
    await publish(nc, path, card.sha256)
    other = Card("other", str(tmp_path / "gone.gguf"), "ab" * 32, SIZE)
    with pytest.raises(WeightsError, match="is not in the cluster's TESSERA_MODELS bucket"):
        await ensure_local(nc, other, cache_dir=tmp_path / "cache")
    with pytest.raises(WeightsError, match="no cluster connection"):
        await ensure_local(None, other, cache_dir=tmp_path / "cache")
    with pytest.raises(WeightsError, match="changed since it was read"):
        await publish(nc, path, "cd" * 32)


async def test_a_device_fetches_with_nothing_but_its_own_grant(
    tmp_path: Path,
) -> None:
    """A device's NATS user (``libs/cluster/access.py``: it may read the bucket, not list
    streams nor administer consumers) fetches the weights."""
    access = AccessControl(["dev-1"])
    config = access.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as server:
        admin = await connect_nats(access.nats_url(server.url, "admin"), "admin")
        device = await connect_nats(access.nats_url(server.url, "dev-1"), "dev-1")
        try:
            path, card = model_file(tmp_path)
            await publish(admin, path, card.sha256)
            away = Card(card.name, str(tmp_path / "gone.gguf"), card.sha256, SIZE)
            local = await ensure_local(device, away, cache_dir=tmp_path / "cache")
            assert local.read_bytes() == path.read_bytes()
        finally:
            await close_nats(device)
            await close_nats(admin)
