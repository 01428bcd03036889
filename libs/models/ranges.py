"""A layer range's bytes of a model, fetched from the cluster's object store (the torch engine).

A torch shard of layers ``[a, b)`` reads only the GGUF's header, its layers' tensors, the token
embedding (first shard; the last too where the LM head is tied to it) and the output norm and
head (last shard). ``fetch_layers`` fetches just the object store chunks that cover those bytes
into a sparse file under ``model_cache_dir()/gguf/<sha256>.sparse.gguf`` (the holes read as
zeros and are never read by the loader), and notes beside it which chunks it holds, so a
second shard on the same host fetches only the chunks it still lacks.

The object's meta carries only the whole file's digest, so ``publish`` (``libs/models/
weights.py``) also puts an **index** into the bucket, object ``<sha256>.index``: each chunk's
stream sequence and sha256, and where each tensor lies (from the GGUF's header). A fetch reads
the index (its own object digest checked), asks JetStream's direct get for runs of chunks by
sequence, and checks every chunk's sha256 before it is written: a chunk that does not match is
refused and nothing of it lands on disk. A model published before indexes existed has none:
its workers fetch the whole file (``weights.ensure_local``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ObjectNotFoundError

from libs.models import bulk_fetch, weights
from libs.models.local_files import Card, cached_path, gguf_dir, holds, is_path, read_json
from libs.models.weights import BUCKET, STREAM, Progress, WeightsError

log = logging.getLogger(__name__)

#: Chunks asked of the bucket by one direct get (8 MiB: progress is reported after each).
BATCH = 16
CHUNK_WAIT_S = 30.0


def index_name(sha256: str) -> str:
    return f"{sha256}.index"


@dataclass(frozen=True)
class Fetched:
    """Where a shard's bytes are, and what this fetch received (0: held already)."""

    path: Path
    received_bytes: int
    chunks_received: int
    whole: bool  #: ``path`` is the whole file (this host had it), not a sparse one


# -- publishing ----------------------------------------------------------------------------------
def tensor_layout(path: Path) -> tuple[int, dict[str, list[int]]]:
    """The GGUF's tensor data offset and each tensor's ``[offset, bytes]`` in the file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return int(reader.data_offset), {
        t.name: [int(t.data_offset), int(t.n_bytes)] for t in reader.tensors
    }


async def publish_index(
    js: JetStreamContext, path: Path, sha256: str, seqs: list[int], digests: list[str]
) -> None:
    """Put the index of the object ``sha256`` (chunk sequences and digests, tensor layout);
    a file that is not a GGUF gets none (it is only ever fetched whole)."""
    try:
        data_offset, tensors = await asyncio.to_thread(tensor_layout, path)
    except Exception as exc:  # not a GGUF: no layer ranges to serve
        log.info("no layer index", extra={"sha256": sha256, "why": str(exc)[:200]})
        return
    index = {
        "sha256": sha256,
        "size": path.stat().st_size,
        "chunk_bytes": weights.CHUNK_BYTES,
        "seqs": seqs,
        "digests": digests,
        "data_offset": data_offset,
        "tensors": tensors,
    }
    store = await weights.bucket(js)
    await store.put(index_name(sha256), json.dumps(index).encode())


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
async def read_index(js: JetStreamContext, sha256: str) -> dict[str, Any] | None:
    """The index of object ``sha256`` (its digest checked), None where there is none."""
    try:
        info = await (await weights.bucket(js)).get_info(index_name(sha256))
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return None
    first = await _first_seq(js, info.nuid)
    async with _reader(js) as reader:
        got = await _get_run(reader, info.nuid, first, info.chunks or 0)
    data = b"".join(chunk for _, chunk in got)
    digest = (info.digest or "").split("=", 1)[-1]
    if hashlib.sha256(data).digest() != base64.urlsafe_b64decode(digest):
        raise WeightsError(f"the layer index of {sha256[:12]} does not match its digest")
    index: dict[str, Any] = json.loads(data)
    if index.get("sha256") != sha256:
        raise WeightsError(f"the layer index of {sha256[:12]} names another file")
    return index


async def _first_seq(js: JetStreamContext, nuid: str) -> int:
    """The stream sequence of an object's first chunk."""
    msg = await js.get_msg(STREAM, subject=f"$O.{BUCKET}.C.{nuid}", seq=1, next=True, direct=True)
    return int(msg.seq or 0)


@contextlib.asynccontextmanager
async def _reader(js: JetStreamContext) -> AsyncIterator[bulk_fetch.DirectGetReader]:
    """A direct-get reader of the bucket's stream, as this connection's user (the one the
    whole-file fetch reads with, ``libs/models/bulk_fetch.py``): no consumer is made."""
    try:
        reader = await asyncio.to_thread(bulk_fetch.DirectGetReader, js._nc, STREAM, CHUNK_WAIT_S)
    except bulk_fetch.BulkFetchError as exc:
        raise WeightsError(f"the {BUCKET} bucket cannot be read: {exc}") from None
    try:
        yield reader
    finally:
        reader.close()


async def _get_run(
    reader: bulk_fetch.DirectGetReader, nuid: str, seq: int, count: int
) -> list[tuple[int, bytes]]:
    """``count`` chunks of object ``nuid`` from stream sequence ``seq`` on, as (sequence,
    data)."""
    return await asyncio.to_thread(_read_run, reader, f"$O.{BUCKET}.C.{nuid}", seq, count)


def _read_run(
    reader: bulk_fetch.DirectGetReader, subject: str, seq: int, count: int
) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    try:
        while len(got) < count:
            reader.ask(subject, seq, count - len(got))
            before = len(got)
            while (message := reader.next()) is not None:
                got.append((message[0], bytes(message[1])))
                seq = got[-1][0] + 1
            if len(got) == before:
                raise WeightsError(f"the {BUCKET} bucket's object lost chunks ({subject})")
    except bulk_fetch.BulkFetchError as exc:
        raise WeightsError(f"the {BUCKET} bucket's chunks stopped coming: {exc}") from None
    return got[:count]


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
    Falls back to the whole file (``weights.ensure_local``) when the bucket holds no index."""
    for whole in _whole_candidates(card, cache_dir):
        if await asyncio.to_thread(holds, whole, card.sha256, card.size_bytes, None, cache_dir):
            return Fetched(whole, 0, 0, whole=True)
    if connection is None:
        raise WeightsError(f"{card.name}'s file is not on this host and no cluster connection")
    js = weights._js(connection)
    index = await read_index(js, card.sha256)
    if index is None or index["size"] != card.size_bytes:
        path = await weights.ensure_local(js, card, progress, cache_dir)
        return Fetched(path, card.size_bytes, -(-card.size_bytes // weights.CHUNK_BYTES), True)
    sparse = gguf_dir(cache_dir) / f"{card.sha256}.sparse.gguf"
    sparse.parent.mkdir(parents=True, exist_ok=True)
    lock = await asyncio.to_thread(weights._lock, sparse.with_suffix(".lock"))
    try:
        return await _fill(
            js, card, index, sparse, needed_ranges(index, start, end, layers), progress
        )
    finally:
        lock.close()


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
    nuid = (await (await weights.bucket(js)).get_info(card.sha256)).nuid
    async with _reader(js) as reader:
        with open(sparse, "r+b" if sparse.exists() else "wb") as file:
            file.truncate(size)
            for run in runs(missing):
                got = await _get_run(reader, nuid, seqs[run[0]], len(run))
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
