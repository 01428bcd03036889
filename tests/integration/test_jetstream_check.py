"""A kept JetStream store is looked at before nats-server opens it (``libs/cluster/
jetstream_check.py``): a store written by a real nats-server (streams, a key-value bucket with
deletes, an object store's big chunks) passes; one damaged in the middle of a block is refused
by ``tessera up``'s home, naming the block and what to do, with nothing changed; a block whose
last record was cut by a crash passes (nats-server drops only that record); the damaged block
moved aside, as the message says, the home opens and nats-server starts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nats
import pytest

from libs.cluster.home import HomeRefused, open_home
from libs.cluster.jetstream_check import damaged
from libs.cluster.servers import NatsServer


def fill(store: Path) -> None:
    """Write a store as the cluster's own are written, with a real nats-server."""
    server = NatsServer(data_dir=store)
    server.start()

    async def write() -> None:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="EVENTS", subjects=["events.>"])
        for i in range(300):
            await js.publish(f"events.{i % 7}", os.urandom(1500), headers={"n": str(i)})
        kv = await js.create_key_value(bucket="SETTINGS")
        for i in range(50):
            await kv.put(f"k{i % 10}", os.urandom(100))
        await kv.delete("k3")
        await kv.purge("k4")
        objects = await js.create_object_store("FILES")
        await objects.put("model", os.urandom(3_000_000))
        await nc.close()

    try:
        asyncio.run(write())
    finally:
        server.close()


def record_offset(data: bytes, index: int) -> int:
    """Where the record ``index`` of a block starts (each record's first 4 bytes: its
    length, the high bit a flag)."""
    at = 0
    for _ in range(index):
        at += int.from_bytes(data[at : at + 4], "little") & 0x7FFFFFFF
    return at


def blocks(store: Path) -> list[Path]:
    return sorted(store.rglob("msgs/*.blk"))


def events_block(store: Path) -> Path:
    return next(b for b in blocks(store) if "EVENTS" in str(b))


def test_a_store_nats_server_wrote_passes(tmp_path: Path) -> None:
    fill(tmp_path)
    assert len(blocks(tmp_path)) >= 3
    assert damaged(tmp_path) == []


def test_a_block_damaged_in_its_middle_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _, lock, _ = open_home(home)  # a home of this version, then its store filled
    os.close(lock)
    fill(home / "nats")
    block = events_block(home / "nats")
    data = bytearray(block.read_bytes())
    at = record_offset(data, 100)
    data[at + 20 : at + 22] = b"\xff\xff"  # its subject's length: 65,535 bytes
    block.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (home / "nats").rglob("*") if p.is_file()}
    with pytest.raises(HomeRefused) as refused:
        open_home(home)
    said = str(refused.value)
    assert str(block) in said and "Nothing was changed" in said
    assert f"mv {block} {block}.damaged" in said and "--fresh" in said
    assert {p: p.read_bytes() for p in (home / "nats").rglob("*") if p.is_file()} == before
    # As the message says: the block moved aside, the home opens and nats-server starts.
    block.rename(block.with_name(block.name + ".damaged"))
    _, lock, _ = open_home(home)
    os.close(lock)
    NatsServer(data_dir=home / "nats").start().close()


def test_a_last_record_cut_by_a_crash_passes(tmp_path: Path) -> None:
    fill(tmp_path)
    block = events_block(tmp_path)
    with block.open("r+b") as file:
        file.truncate(block.stat().st_size - 700)
    assert damaged(tmp_path) == []
