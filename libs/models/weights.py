"""Model weights carried by the cluster: a JetStream object store, fetched once per host.

Only the host where a model was added needs its file. ``publish`` puts the GGUF into the
object store bucket ``TESSERA_MODELS`` (the object's name is the file's sha256, in chunks of
``CHUNK_BYTES``, each acknowledged by JetStream), once: a model already there with the same
digest is not sent again. A worker calls ``ensure_local`` before its engine opens the file: it
answers the card's own source path where this host has that file (same size, same digest),
else a copy under ``model_cache_dir()/gguf/<sha256>.gguf``, fetched from the bucket over the
worker's NATS connection (TLS and the cluster's credentials when the cluster uses them).

A fetch writes ``<sha256>.gguf.part`` and, beside it, how far it got (the stream sequence of
the last chunk written): a fetch cut short (the worker stopped, the link went down) resumes
from there. The whole file's sha256 is checked before the part is renamed into place, so a
copy under its digest's name is always whole. Hashing a gigabyte takes seconds, so a file once
verified gets a marker (its path, size and modification time): the next check reads the
marker, not the file.

The object layout is the one every NATS client's object store reads (``$O.<bucket>.C.<nuid>``
chunks, ``$O.<bucket>.M.<name>`` meta with a rollup header): ``nats object get`` works too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from libs.models.gguf_info import sha256_of
from libs.runtime.settings import model_cache_dir

log = logging.getLogger(__name__)

BUCKET = "TESSERA_MODELS"
STREAM = f"OBJ_{BUCKET}"
#: Bytes per object store chunk: under NATS's default 1 MB message limit with room for headers,
#: and few enough acknowledgements per gigabyte (2,048) that they cost little.
CHUNK_BYTES = 512 * 1024
#: Chunk publishes in flight before the next waits for acknowledgements.
IN_FLIGHT = 64
#: Seconds to wait for JetStream's acknowledgements of the chunks in flight.
ACK_WAIT_S = 30.0
#: Seconds a fetch waits for the next chunk before it says the bucket stopped answering.
CHUNK_WAIT_S = 30.0
READ_BYTES = 4 * 1024 * 1024
#: Chunks asked of the bucket at a time (32 MiB).
BATCH = 64
#: Chunks received and waiting to be hashed and written; written WRITE_CHUNKS at a time.
QUEUED = 32
WRITE_CHUNKS = 8

#: ``progress(bytes_done, bytes_total)``: called as weights move (hashing, sending, fetching).
Progress = Callable[[int, int], None]


class WeightsError(RuntimeError):
    """The weights could not be delivered: the cause is in the message."""


class Card(Protocol):
    """What of a model card weights delivery reads (``libs/contracts`` ``ModelCard``)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...


def gguf_dir(cache_dir: Path | None = None) -> Path:
    """Where fetched (and downloaded) GGUF files live, each named by its sha256."""
    return (cache_dir or model_cache_dir()) / "gguf"


def is_path(source: str) -> bool:
    """Whether a card's source names a file (not a URL, not ``hf:``)."""
    return "://" not in source and not source.startswith("hf:")


def cached_path(sha256: str, cache_dir: Path | None = None) -> Path:
    return gguf_dir(cache_dir) / f"{sha256}.gguf"


# -- verified markers ----------------------------------------------------------------------------
def _marker(sha256: str, cache_dir: Path | None) -> Path:
    return gguf_dir(cache_dir) / "verified" / f"{sha256}.json"


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def mark_verified(path: Path, sha256: str, cache_dir: Path | None = None) -> None:
    """Remember that ``path``, as it is now (size, modification time, inode), hashes to
    ``sha256``."""
    marker = _marker(sha256, cache_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    known = _read_marker(marker)
    known[str(path.resolve())] = _stamp(path)
    tmp = marker.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(marker)


def _read_marker(marker: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(marker.read_text())
        if isinstance(known, dict):
            return known
    return {}


def holds(
    path: Path,
    sha256: str,
    size_bytes: int,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
) -> bool:
    """Whether ``path`` is this model's file: its size, then its digest (from the marker while
    the file is unchanged since it was verified, else hashed once and marked)."""
    try:
        if not path.is_file() or path.stat().st_size != size_bytes:
            return False
        if _read_marker(_marker(sha256, cache_dir)).get(str(path.resolve())) == _stamp(path):
            return True
        if sha256_of(path, progress) != sha256:
            return False
    except OSError:
        return False
    mark_verified(path, sha256, cache_dir)
    return True


# -- the bucket ----------------------------------------------------------------------------------
def _js(connection: NatsClient | JetStreamContext) -> JetStreamContext:
    return connection.jetstream() if isinstance(connection, NatsClient) else connection


def _digest(sha256: str) -> str:
    """The object store's digest header for a sha256 given in hex."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256)).decode()


def _meta_subject(name: str) -> str:
    return f"$O.{BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


async def bucket(js: JetStreamContext, create: bool = False) -> ObjectStore:
    """The ``TESSERA_MODELS`` object store (created when ``create`` and missing)."""
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
    js = _js(connection)
    try:
        info = await (await bucket(js)).get_info(sha256)
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return None
    return info if info.digest == _digest(sha256) else None


async def publish(
    connection: NatsClient | JetStreamContext,
    path: Path,
    sha256: str,
    progress: Progress | None = None,
) -> bool:
    """Put the file at ``path`` into the bucket under ``sha256`` (its digest, hex). False when
    the bucket holds it already (nothing sent); raises ``WeightsError`` when the file read now
    does not hash to ``sha256`` (changed since it was read), and then leaves nothing behind."""
    js = _js(connection)
    await bucket(js, create=True)
    if await stored(js, sha256) is not None:
        return False
    nuid = js._nc._nuid.next().decode()  # the object store's own chunk naming
    chunks_subject = f"$O.{BUCKET}.C.{nuid}"
    digest, size, count = hashlib.sha256(), path.stat().st_size, 0
    pending: list[asyncio.Future[api.PubAck]] = []
    try:
        with open(path, "rb") as file:
            while piece := await asyncio.to_thread(file.read, CHUNK_BYTES):
                digest.update(piece)
                pending.append(await js.publish_async(chunks_subject, piece))
                count += 1
                if len(pending) >= IN_FLIGHT:
                    await asyncio.wait_for(asyncio.gather(*pending), ACK_WAIT_S)
                    pending.clear()
                    if progress is not None:
                        progress(min(count * CHUNK_BYTES, size), size)
            await asyncio.wait_for(asyncio.gather(*pending), ACK_WAIT_S)
        if digest.hexdigest() != sha256:
            raise WeightsError(
                f"{path} does not hash to {sha256} any more (it changed since it was read)"
            )
        info = api.ObjectInfo(
            name=sha256,
            bucket=BUCKET,
            nuid=nuid,
            size=size,
            chunks=count,
            digest=_digest(sha256),
            mtime=datetime.now(UTC).isoformat(),
            description=path.name,
            options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
        )
        await js.publish(
            _meta_subject(sha256),
            json.dumps(info.as_dict()).encode(),
            headers={api.Header.ROLLUP: "sub"},
        )
    except BaseException:
        with contextlib.suppress(Exception):
            await js.purge_stream(STREAM, subject=chunks_subject)
        raise
    if progress is not None:
        progress(size, size)
    log.info("weights published", extra={"sha256": sha256, "bytes": size, "chunks": count})
    return True


async def publish_to(
    nats_url: str, ca_file: Path | None, path: Path, sha256: str, progress: Progress | None = None
) -> bool:
    """``publish`` over a connection of its own (``tessera models add``, as the cluster's
    admin: the run file's NATS URL and CA)."""
    from libs.runtime.nats_client import close_nats, connect_nats

    nc = await connect_nats(nats_url, "models-add", ca_file=ca_file)
    try:
        return await publish(nc, path, sha256, progress)
    finally:
        await close_nats(nc)


async def unpublish(connection: NatsClient | JetStreamContext, sha256: str) -> bool:
    """Remove the model of that digest from the bucket (``models rm``); False when absent."""
    try:
        await (await bucket(_js(connection))).delete(sha256)
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return False
    return True


# -- fetching ------------------------------------------------------------------------------------
async def ensure_local(
    connection: NatsClient | JetStreamContext | None,
    card: Card,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """This model's file on this host: the card's source path where this host holds it, else
    the verified copy in the cache, fetched from the bucket first when missing (once per host:
    workers sharing the cache wait for one another's fetch). ``progress(bytes, total)`` follows
    a fetch. Raises ``WeightsError`` naming the cause (no connection, not in the bucket, a
    digest that does not match)."""
    if is_path(card.source):
        source = Path(card.source).expanduser()
        if await asyncio.to_thread(holds, source, card.sha256, card.size_bytes, None, cache_dir):
            return source
    target = cached_path(card.sha256, cache_dir)
    if await asyncio.to_thread(holds, target, card.sha256, card.size_bytes, None, cache_dir):
        return target
    if connection is None:
        raise WeightsError(f"{card.name}'s file is not on this host and no cluster connection")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = await asyncio.to_thread(_lock, target.with_suffix(".lock"))
    try:
        if not await asyncio.to_thread(
            holds, target, card.sha256, card.size_bytes, None, cache_dir
        ):
            await fetch(_js(connection), card, target, progress)
            mark_verified(target, card.sha256, cache_dir)
    finally:
        lock.close()
    return target


def _lock(path: Path) -> BinaryIO:
    file = open(path, "wb")  # noqa: SIM115 - held until the fetch ends
    fcntl.flock(file, fcntl.LOCK_EX)
    return file


async def fetch(
    js: JetStreamContext, card: Card, target: Path, progress: Progress | None = None
) -> None:
    """Fetch the card's object from the bucket into ``target`` (resuming a part fetched
    before), check its sha256 and size, then rename it into place."""
    try:
        info = await (await bucket(js)).get_info(card.sha256)
    except (ObjectNotFoundError, NotFoundError):
        raise WeightsError(
            f"{card.name} ({card.sha256[:12]}) is not in the cluster's {BUCKET} bucket: "
            "add it again on the host that has its file"
        ) from None
    if info.digest != _digest(card.sha256) or info.size != card.size_bytes:
        raise WeightsError(f"the bucket's {card.sha256[:12]} is not {card.name}'s file")
    part, state_file = target.with_suffix(".gguf.part"), target.with_suffix(".gguf.part.json")
    digest, done, next_seq = hashlib.sha256(), 0, 1
    state = _read_marker(state_file)
    if state.get("nuid") == info.nuid and part.exists():
        done, next_seq = int(state["bytes"]), int(state["seq"]) + 1
        await asyncio.to_thread(_rehash, part, done, digest)  # the part as far as it is whole
        log.info("weights fetch resumed", extra={"sha256": card.sha256, "bytes": done})
    total = card.size_bytes
    with open(part, "r+b" if done else "wb") as file:
        file.truncate(done)
        file.seek(done)
        if done < total:
            await _receive(js, info.nuid, next_seq, file, digest, done, total, state_file, progress)
    if digest.hexdigest() != card.sha256:
        part.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
        raise WeightsError(f"{card.name}'s fetched file does not hash to {card.sha256}: refused")
    part.replace(target)
    state_file.unlink(missing_ok=True)
    log.info("weights fetched", extra={"sha256": card.sha256, "bytes": total})


def _rehash(part: Path, length: int, digest: Any) -> None:
    with open(part, "rb") as file:
        left = length
        while left > 0 and (piece := file.read(min(READ_BYTES, left))):
            digest.update(piece)
            left -= len(piece)
        if left:
            raise WeightsError(f"{part} is shorter than its recorded {length} bytes")


async def _receive(
    js: JetStreamContext,
    nuid: str,
    start_seq: int,
    file: BinaryIO,
    digest: Any,
    done: int,
    total: int,
    state_file: Path,
    progress: Progress | None,
) -> None:
    """Chunks from stream sequence ``start_seq`` on, appended to ``file`` in order; after each,
    how far it got goes to ``state_file`` (so a cut fetch resumes). Hashing and writing run on a
    thread while the next chunks arrive (a queue of ``QUEUED`` chunks between them).

    The chunks come by JetStream's direct get, ``BATCH`` at a time (``$JS.API.DIRECT.GET.
    <stream>``: the next messages of the object's chunk subject from a sequence on, then an
    end-of-batch status), onto this connection's own inbox: no consumer is made, so a device's
    grant names no consumer API on the bucket (``MODEL_READ``), and none it could turn into a
    push consumer delivering the weights onto another subject."""
    nc = js._nc
    subject = f"$O.{BUCKET}.C.{nuid}"
    sub = await nc.subscribe(nc.new_inbox(), pending_bytes_limit=4 * BATCH * CHUNK_BYTES)
    queue: asyncio.Queue[tuple[bytes, int, int] | None] = asyncio.Queue(QUEUED)

    def write(items: list[tuple[bytes, int, int]]) -> None:
        for data, _, _ in items:
            digest.update(data)
            file.write(data)
        file.flush()
        _, seq, upto = items[-1]
        state_file.write_text(json.dumps({"nuid": nuid, "bytes": upto, "seq": seq}))

    async def writer() -> None:
        """Write what has arrived, up to ``WRITE_CHUNKS`` chunks per trip to the thread."""
        end = False
        while not end:
            items = [await queue.get()]
            while len(items) < WRITE_CHUNKS and not queue.empty():
                items.append(queue.get_nowait())
            end = items[-1] is None
            chunks = [item for item in items if item is not None]
            if chunks:
                await asyncio.to_thread(write, chunks)
                if progress is not None:
                    progress(chunks[-1][2], total)

    writing = asyncio.create_task(writer())
    next_seq = start_seq
    try:
        while done < total:
            ask = {"seq": next_seq, "next_by_subj": subject, "batch": BATCH}
            await nc.publish(f"$JS.API.DIRECT.GET.{STREAM}", json.dumps(ask).encode(), sub.subject)
            while (msg := await _next(sub, done, total)) is not None:
                done += len(msg.data)
                if done > total:
                    raise WeightsError(f"the bucket's object is longer than {total} bytes")
                next_seq = int(msg.headers["Nats-Sequence"]) + 1  # type: ignore[index]
                await _put(queue, (msg.data, next_seq - 1, done), writing)
        await _put(queue, None, writing)
        await writing
    finally:
        writing.cancel()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _next(sub: Subscription, done: int, total: int) -> Msg | None:
    """The next chunk a direct get sent, None at the end of its batch."""
    try:
        msg = await sub.next_msg(timeout=CHUNK_WAIT_S)
    except TimeoutError:
        raise WeightsError(
            f"the {BUCKET} bucket sent nothing for {CHUNK_WAIT_S:.0f} s at byte {done} of {total}"
        ) from None
    headers = msg.headers or {}
    status = headers.get(api.Header.STATUS)
    if status == "204":  # the batch's end
        return None
    if status is not None or "Nats-Sequence" not in headers:
        said = f"{status} {headers.get(api.Header.DESCRIPTION, '')}".strip()
        raise WeightsError(
            f"the {BUCKET} bucket answered {said or 'a message without a sequence'} at byte "
            f"{done} of {total} (404: the object lost chunks; 503: no direct get on its stream)"
        )
    return msg


async def _put(queue: asyncio.Queue[Any], item: Any, writing: asyncio.Task[None]) -> None:
    """Queue ``item`` for the writer, raising what the writer raised if it stopped."""
    if not writing.done():
        put = asyncio.ensure_future(queue.put(item))
        await asyncio.wait({put, writing}, return_when=asyncio.FIRST_COMPLETED)
        put.cancel()
    if writing.done():
        writing.result()
