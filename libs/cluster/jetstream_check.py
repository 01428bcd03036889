"""A look at a kept JetStream store before nats-server opens it.

nats-server, finding a record of a message block it cannot parse, logs a warning and cuts the
block there: every message from that record on is gone, silently (tried with nats-server
2.15: a block damaged in its middle was left empty, "Restored 0 messages"). ``damaged``
walks each block's records as nats-server does (``msgs/*.blk``: records of a 22-byte header,
whose first 4 bytes are the record's length, high bit "has headers"; then the subject, the
payload and an 8-byte hash) and names every block with a record whose lengths do not hold, so
that ``tessera up`` refuses to start on it and says what to do instead. A last record cut
short by a crash is not damage: nats-server drops it, and only it. (A length damaged so that
it runs past the block's end looks the same, unless it is longer than any record can be.)
Compressed or encrypted stores (not Tessera's) are not looked at. The records' hashes are
not checked (nats-server checks those as it reads).
"""

from __future__ import annotations

import struct
from pathlib import Path

#: A record's header: length (u32), sequence (u64), timestamp (i64), subject length (u16).
HEADER = struct.Struct("<IQqH")
HASH_BYTES = 8
HAS_HEADERS = 1 << 31
#: No record is longer (nats-server's own bound: its largest payload is 64 MiB).
LONGEST = 64 << 20


def damaged(store: Path) -> list[str]:
    """Each message block under ``store`` (a nats-server's data folder) with a record whose
    lengths do not hold, with where: "PATH: record at byte N: why"."""
    found = []
    for block in sorted(store.rglob("msgs/*.blk")):
        why = block_damage(block)
        if why:
            found.append(f"{block}: {why}")
    return found


def block_damage(block: Path) -> str:
    """Why ``block``'s records do not hold ("" when they do)."""
    size = block.stat().st_size
    with block.open("rb") as file:
        at = 0
        while at < size:
            file.seek(at)
            head = file.read(HEADER.size)
            if len(head) < HEADER.size:
                return ""  # a header cut short at the end: a torn last write
            length, _seq, _ts, subject = HEADER.unpack(head)
            length &= ~HAS_HEADERS
            if length > LONGEST:
                return f"record at byte {at}: length {length}"
            if at + length > size:
                return ""  # the last record cut short: a torn last write
            if length < HEADER.size + HASH_BYTES or subject > length - HEADER.size - HASH_BYTES:
                return f"record at byte {at}: length {length}, subject length {subject}"
            at += length
    return ""
