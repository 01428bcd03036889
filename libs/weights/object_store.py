"""The cluster's model store: the JetStream object store bucket ``TESSERA_MODELS``, the layer
index kept beside each model in it, and this host's locks on what is fetched from it.

Every other module of ``libs/weights`` reaches the store through this one.

**Objects.** A model's file is the object named by its sha256, in chunks of ``CHUNK_BYTES``,
laid out as every NATS client's object store reads it (``$O.<bucket>.C.<nuid>`` chunks,
``$O.<bucket>.M.<name>`` meta with a rollup header), so ``nats object get`` works too. The meta
carries only the whole file's digest.

**The index.** Beside the model, object ``<sha256>.index``: each chunk's stream sequence and
sha256, and where each tensor lies in the file (from the GGUF's header). A layer range is
fetched by it (``libs/weights/layer_ranges.py``) and a lent file checked chunk by chunk
(``libs/weights/stripes.py``). A file that is not a GGUF, or a model put into the store before
indexes existed, has none: it is only ever fetched whole.

**Reading chunks.** By JetStream's direct get on the bucket's stream, as the connection's own
user (``bulk_fetch.DirectGetReader``): no consumer is made, so a device's grant names no
consumer API on the bucket.

**Locks.** A file fetched into this host's cache is written under an exclusive lock beside it
(``host_lock``), so workers sharing the cache wait for one another's fetch.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from libs.runtime.nats_private import client_of
from libs.weights import bulk_fetch

log = logging.getLogger(__name__)

BUCKET = "TESSERA_MODELS"
STREAM = f"OBJ_{BUCKET}"
#: Bytes per object store chunk: under NATS's default 1 MB message limit with room for headers,
#: and few enough acknowledgements per gigabyte (2,048) that they cost little.
CHUNK_BYTES = 512 * 1024
#: Seconds a fetch waits for the next chunk before it says the bucket stopped answering.
CHUNK_WAIT_S = 30.0


class WeightsError(RuntimeError):
    """The weights could not be delivered: the cause is in the message."""


# -- the bucket and its objects ------------------------------------------------------------------
def jetstream(connection: NatsClient | JetStreamContext) -> JetStreamContext:
    """The JetStream context of a connection (a context given is answered as it is)."""
    return connection.jetstream() if isinstance(connection, NatsClient) else connection


def object_digest(sha256: str) -> str:
    """The object store's digest header for a sha256 given in hex."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256)).decode()


def meta_subject(name: str) -> str:
    """The subject of object ``name``'s meta (its ``ObjectInfo``, rolled up)."""
    return f"$O.{BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(nuid: str) -> str:
    """The subject of the chunks of the object whose meta names ``nuid``."""
    return f"$O.{BUCKET}.C.{nuid}"


async def bucket(js: JetStreamContext, create: bool = False) -> ObjectStore:
    """The ``TESSERA_MODELS`` object store (created when ``create`` and missing); raises
    ``WeightsError`` where it is missing and not created."""
    try:
        return await js.object_store(BUCKET)
    except (BucketNotFoundError, NotFoundError):
        if not create:
            raise WeightsError(
                f"the cluster holds no model weights yet (no {BUCKET} bucket): "
                "add the model with `tessera models add` on the host that has its file"
            ) from None
    config = api.ObjectStoreConfig(description="model weights by sha256")
    return await js.create_object_store(BUCKET, config=config)


async def stored(connection: NatsClient | JetStreamContext, sha256: str) -> api.ObjectInfo | None:
    """The bucket's object of that digest, None when it holds none (or no bucket exists)."""
    try:
        info = await (await bucket(jetstream(connection))).get_info(sha256)
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return None
    return info if info.digest == object_digest(sha256) else None


# -- the layer index -----------------------------------------------------------------------------
def index_name(sha256: str) -> str:
    """The name of the index object of the model ``sha256``."""
    return f"{sha256}.index"


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
    """Put the index of the object ``sha256`` (its chunks' stream sequences and sha256s, in
    order; the tensor layout read from ``path``); a file that is not a GGUF gets none."""
    try:
        data_offset, tensors = await asyncio.to_thread(tensor_layout, path)
    except Exception as exc:  # not a GGUF: no layer ranges to serve
        log.info("no layer index", extra={"sha256": sha256, "why": str(exc)[:200]})
        return
    index = {
        "sha256": sha256,
        "size": path.stat().st_size,
        "chunk_bytes": CHUNK_BYTES,
        "seqs": seqs,
        "digests": digests,
        "data_offset": data_offset,
        "tensors": tensors,
    }
    store = await bucket(js)
    await store.put(index_name(sha256), json.dumps(index).encode())


async def read_index(js: JetStreamContext, sha256: str) -> dict[str, Any] | None:
    """The index of object ``sha256``, None where there is none; raises ``WeightsError`` where
    it does not match its own digest or names another file."""
    try:
        info = await (await bucket(js)).get_info(index_name(sha256))
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return None
    first = await _first_seq(js, info.nuid)
    async with direct_reader(js) as reader:
        got = await read_chunks(reader, info.nuid, first, info.chunks or 0)
    data = b"".join(chunk for _, chunk in got)
    digest = (info.digest or "").split("=", 1)[-1]
    if hashlib.sha256(data).digest() != base64.urlsafe_b64decode(digest):
        raise WeightsError(f"the layer index of {sha256[:12]} does not match its digest")
    index: dict[str, Any] = json.loads(data)
    if index.get("sha256") != sha256:
        raise WeightsError(f"the layer index of {sha256[:12]} names another file")
    return index


# -- reading chunks ------------------------------------------------------------------------------
async def _first_seq(js: JetStreamContext, nuid: str) -> int:
    """The stream sequence of an object's first chunk."""
    msg = await js.get_msg(STREAM, subject=chunk_subject(nuid), seq=1, next=True, direct=True)
    return int(msg.seq or 0)


@contextlib.asynccontextmanager
async def direct_reader(js: JetStreamContext) -> AsyncIterator[bulk_fetch.DirectGetReader]:
    """A direct-get reader of the bucket's stream, as this connection's user (the one the
    whole-file fetch reads with, ``libs/weights/bulk_fetch.py``): no consumer is made."""
    nc = client_of(js)
    try:
        reader = await asyncio.to_thread(bulk_fetch.DirectGetReader, nc, STREAM, CHUNK_WAIT_S)
    except bulk_fetch.BulkFetchError as exc:
        raise WeightsError(f"the {BUCKET} bucket cannot be read: {exc}") from None
    try:
        yield reader
    finally:
        reader.close()


async def read_chunks(
    reader: bulk_fetch.DirectGetReader, nuid: str, seq: int, count: int
) -> list[tuple[int, bytes]]:
    """``count`` chunks of object ``nuid`` from stream sequence ``seq`` on, as (sequence,
    data); raises ``WeightsError`` where the object lost chunks or the bucket stops answering."""
    return await asyncio.to_thread(_read_run, reader, chunk_subject(nuid), seq, count)


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


# -- this host's locks ---------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def host_lock(path: Path) -> AsyncIterator[None]:
    """Hold the exclusive lock of the file ``path`` (created where missing) until the block
    ends: every process of this host that fetches into the same place takes it first."""
    file = await asyncio.to_thread(_locked, path)
    try:
        yield
    finally:
        file.close()


def _locked(path: Path) -> Any:
    file = open(path, "wb")  # noqa: SIM115 - held until the fetch ends
    fcntl.flock(file, fcntl.LOCK_EX)
    return file
