"""A layer range's bytes of a model, fetched from the cluster's object store (the torch engine).

A torch shard of layers ``[a, b)`` reads only the GGUF's header, its layers' tensors, the token
embedding (first shard; the last too where the LM head is tied to it) and the output norm and
head (last shard). ``fetch_layers`` fetches just the object store chunks that cover those bytes
into a sparse file under ``model_cache_dir()/gguf/<sha256>.sparse.gguf`` (the holes read as
zeros and are never read by the loader), and notes beside it which chunks it holds, so a
second shard on the same host fetches only the chunks it still lacks.

The object's meta carries only the whole file's digest, so a fetch reads the store's **index**
of the model (``libs/weights/object_store.py``: each chunk's stream sequence and sha256, where
each tensor lies; its own object digest checked), asks JetStream's direct get for runs of chunks
by sequence, and checks every chunk's sha256 before it is written: a chunk that does not match
is refused and nothing of it lands on disk. A model published before indexes existed has none:
its workers fetch the whole file (``whole_files.ensure_local``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from libs.models.gguf_info import Progress
from libs.weights.local_files import Card, cached_path, gguf_dir, holds, is_path, read_json
from libs.weights.object_store import (
    CHUNK_BYTES,
    WeightsError,
    bucket,
    direct_reader,
    host_lock,
    jetstream,
    read_chunks,
    read_index,
)
from libs.weights.whole_files import ensure_local

log = logging.getLogger(__name__)

#: Chunks asked of the bucket by one direct get (8 MiB: progress is reported after each).
BATCH = 16


@dataclass(frozen=True)
class Fetched:
    """Where a shard's bytes are, and what this fetch received (0: held already)."""

    path: Path
    received_bytes: int
    chunks_received: int
    whole: bool  #: ``path`` is the whole file (this host had it), not a sparse one


# -- what a shard needs --------------------------------------------------------------------------
def wanted_tensor(name: str, start: int, end: int, layers: int) -> bool:
    """Whether a shard of layers ``[start, end)`` of ``layers`` reads tensor ``name``."""
    if name.startswith("blk."):
        return start <= int(name.split(".")[1]) < end
    if name.startswith("token_embd"):
        return start == 0
    if name.startswith("output"):
        return end == layers
    return start == 0  # anything else before the layers (rope factors, …) goes with the first


def needed_ranges(index: dict[str, Any], start: int, end: int, layers: int) -> list[range]:
    """Byte ranges of the file a shard reads: the header, then its tensors (the embedding
    again on the last shard when there is no ``output.weight``: the head is tied to it)."""
    tensors: dict[str, list[int]] = index["tensors"]
    tied_head = "output.weight" not in tensors and end == layers
    spans = [range(0, int(index["data_offset"]))]
    for name, (offset, size) in tensors.items():
        if wanted_tensor(name, start, end, layers) or (tied_head and name == "token_embd.weight"):
            spans.append(range(offset, offset + size))
    return spans


def chunks_of(spans: list[range], chunk_bytes: int) -> list[int]:
    """The chunk indices covering ``spans``, sorted."""
    wanted: set[int] = set()
    for span in spans:
        if len(span):
            wanted.update(range(span.start // chunk_bytes, (span.stop - 1) // chunk_bytes + 1))
    return sorted(wanted)


def runs(indices: list[int], most: int = BATCH) -> list[list[int]]:
    """Consecutive indices grouped, at most ``most`` per group."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] == i - 1 and len(out[-1]) < most:
            out[-1].append(i)
        else:
            out.append([i])
    return out


# -- fetching ------------------------------------------------------------------------------------
async def fetch_layers(
    connection: NatsClient | JetStreamContext | None,
    card: Card,
    start: int,
    end: int,
    layers: int,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
) -> Fetched:
    """A file holding what a shard of layers ``[start, end)`` (of ``layers``) reads: the
    whole file where this host has it, else the sparse copy, its missing chunks fetched and
    checked first. ``progress(bytes, total)`` follows the chunks this shard still lacked.
    Falls back to the whole file (``whole_files.ensure_local``) when the bucket holds no index."""
    for whole in _whole_candidates(card, cache_dir):
        if await asyncio.to_thread(holds, whole, card.sha256, card.size_bytes, None, cache_dir):
            return Fetched(whole, 0, 0, whole=True)
    if connection is None:
        raise WeightsError(f"{card.name}'s file is not on this host and no cluster connection")
    js = jetstream(connection)
    index = await read_index(js, card.sha256)
    if index is None or index["size"] != card.size_bytes:
        path = await ensure_local(js, card, progress, cache_dir)
        return Fetched(path, card.size_bytes, -(-card.size_bytes // CHUNK_BYTES), True)
    sparse = gguf_dir(cache_dir) / f"{card.sha256}.sparse.gguf"
    sparse.parent.mkdir(parents=True, exist_ok=True)
    async with host_lock(sparse.with_suffix(".lock")):
        return await _fill(
            js, card, index, sparse, needed_ranges(index, start, end, layers), progress
        )


def _whole_candidates(card: Card, cache_dir: Path | None) -> list[Path]:
    paths = [cached_path(card.sha256, cache_dir)]
    if is_path(card.source):
        paths.insert(0, Path(card.source).expanduser())
    return paths


async def _fill(
    js: JetStreamContext,
    card: Card,
    index: dict[str, Any],
    sparse: Path,
    spans: list[range],
    progress: Progress | None,
) -> Fetched:
    """Fetch the chunks covering ``spans`` that ``sparse`` lacks, each checked, and note them."""
    size, chunk_bytes = int(index["size"]), int(index["chunk_bytes"])
    seqs = index["seqs"]
    held_file = sparse.with_suffix(".json")
    held: set[int] = set(read_json(held_file).get("chunks", []))
    if not sparse.exists():
        held = set()
    missing = [i for i in chunks_of(spans, chunk_bytes) if i not in held]
    total = sum(min(chunk_bytes, size - i * chunk_bytes) for i in missing)
    if not missing:  # a shard of this host held every chunk already
        return Fetched(sparse, 0, 0, whole=False)
    received, done = 0, 0
    nuid = (await (await bucket(js)).get_info(card.sha256)).nuid
    async with direct_reader(js) as reader:
        with open(sparse, "r+b" if sparse.exists() else "wb") as file:
            file.truncate(size)
            for run in runs(missing):
                got = await read_chunks(reader, nuid, seqs[run[0]], len(run))
                received += sum(len(data) for _, data in got)
                pieces = [(i, seq, data) for i, (seq, data) in zip(run, got, strict=True)]
                await asyncio.to_thread(_check_and_write, file, pieces, index, card.name)
                held.update(run)
                held_file.write_text(json.dumps({"chunks": sorted(held)}))
                done += sum(len(data) for _, data in got)
                if progress is not None:
                    progress(done, total)
    log.info(
        "layer range fetched",
        extra={"sha256": card.sha256, "bytes": received, "chunks": len(missing), "file": size},
    )
    return Fetched(sparse, received, len(missing), whole=False)


def _check_and_write(
    file: Any, pieces: list[tuple[int, int, bytes]], index: dict[str, Any], name: str
) -> None:
    """Check each chunk (its stream sequence and sha256 against the index), then write them
    at their offsets: a run with one chunk that does not match writes nothing."""
    for i, seq, data in pieces:
        if seq != index["seqs"][i] or hashlib.sha256(data).hexdigest() != index["digests"][i]:
            raise WeightsError(f"chunk {i} of {name}'s file does not match its index: refused")
    for i, _, data in pieces:
        file.seek(i * int(index["chunk_bytes"]))
        file.write(data)
    file.flush()
