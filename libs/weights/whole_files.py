"""A model's whole file carried by the cluster: put into its object store once, fetched once
per host (the store itself, its index and its locks: ``libs/weights/object_store.py``).

Only the host where a model was added needs its file. ``publish`` puts the GGUF into the
object store bucket ``TESSERA_MODELS`` (the object's name is the file's sha256, in chunks of
``CHUNK_BYTES``, each acknowledged by JetStream), once: a model already there with the same
digest is not sent again. A worker calls ``ensure_local`` before its engine opens the file: it
answers the card's own source path where this host has that file (same size, same digest),
else a copy under ``model_cache_dir()/gguf/<sha256>.gguf``, fetched from the bucket as the
worker's NATS user (TLS and the cluster's credentials when the cluster uses them): the object's
info through the worker's connection, its chunks through a second connection of the same user
that ``bulk_fetch`` reads lean (nats-py's receive path is slower than the link).

A fetch writes ``<sha256>.gguf.part`` and, beside it, how far it got (the stream sequence of
the last chunk written): a fetch cut short (the worker stopped, the link went down) resumes
from there. The whole file's sha256 is checked before the part is renamed into place, so a
copy under its digest's name is always whole. A file once verified gets a marker, so the next
check need not hash it again (``libs/weights/local_files.py``: the cache's layout and markers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError, ObjectNotFoundError

from libs.models.gguf_info import Progress
from libs.runtime.nats_private import client_of, next_nuid
from libs.weights import borrowing, bulk_fetch, lending
from libs.weights.local_files import Card, cached_path, holds, is_path, mark_verified, read_json
from libs.weights.object_store import (
    BUCKET,
    CHUNK_BYTES,
    CHUNK_WAIT_S,
    STREAM,
    WeightsError,
    bucket,
    chunk_subject,
    host_lock,
    index_name,
    jetstream,
    meta_subject,
    object_digest,
    publish_index,
    read_index,
    stored,
)

log = logging.getLogger(__name__)

#: Chunk publishes in flight before the next waits for acknowledgements.
IN_FLIGHT = 64
#: Seconds to wait for JetStream's acknowledgements of the chunks in flight.
ACK_WAIT_S = 30.0


# -- publishing ----------------------------------------------------------------------------------
async def publish(
    connection: NatsClient | JetStreamContext,
    path: Path,
    sha256: str,
    progress: Progress | None = None,
) -> bool:
    """Put the file at ``path`` into the bucket under ``sha256`` (its digest, hex). False when
    the bucket holds it already (nothing sent); raises ``WeightsError`` when the file read now
    does not hash to ``sha256`` (changed since it was read), and then leaves nothing behind."""
    js = jetstream(connection)
    await bucket(js, create=True)
    if await stored(js, sha256) is not None:
        return False
    nuid = next_nuid(client_of(js))  # the object store's own chunk naming
    chunks_subject = chunk_subject(nuid)
    digest, size, count = hashlib.sha256(), path.stat().st_size, 0
    pending: list[asyncio.Future[api.PubAck]] = []
    # Each chunk's stream sequence and sha256: the layer index (object_store.publish_index).
    seqs: list[int] = []
    chunk_digests: list[str] = []
    try:
        with open(path, "rb") as file:
            while piece := await asyncio.to_thread(file.read, CHUNK_BYTES):
                digest.update(piece)
                chunk_digests.append(hashlib.sha256(piece).hexdigest())
                pending.append(await js.publish_async(chunks_subject, piece))
                count += 1
                if len(pending) >= IN_FLIGHT:
                    acks = await asyncio.wait_for(asyncio.gather(*pending), ACK_WAIT_S)
                    seqs.extend(ack.seq for ack in acks)
                    pending.clear()
                    if progress is not None:
                        progress(min(count * CHUNK_BYTES, size), size)
            acks = await asyncio.wait_for(asyncio.gather(*pending), ACK_WAIT_S)
            seqs.extend(ack.seq for ack in acks)
        if digest.hexdigest() != sha256:
            raise WeightsError(
                f"{path} does not hash to {sha256} any more (it changed since it was read)"
            )
        # Before the meta: a worker that finds the object finds its index too.
        await publish_index(js, path, sha256, seqs, chunk_digests)
        info = api.ObjectInfo(
            name=sha256,
            bucket=BUCKET,
            nuid=nuid,
            size=size,
            chunks=count,
            digest=object_digest(sha256),
            mtime=datetime.now(UTC).isoformat(),
            description=path.name,
            options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
        )
        await js.publish(
            meta_subject(sha256),
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
    store = None
    with contextlib.suppress(WeightsError, ObjectNotFoundError, NotFoundError):
        store = await bucket(jetstream(connection))
        await store.delete(index_name(sha256))
    try:
        await (store or await bucket(jetstream(connection))).delete(sha256)
    except (WeightsError, ObjectNotFoundError, NotFoundError):
        return False
    return True


# -- fetching ------------------------------------------------------------------------------------
async def ensure_local(
    connection: NatsClient | JetStreamContext | None,
    card: Card,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    device_id: str | None = None,
    streams: int | None = None,
) -> Path:
    """This model's file on this host: the card's source path where this host holds it, else
    the verified copy in the cache, fetched first when missing (once per host: workers sharing
    the cache wait for one another's fetch) — lent by a device that holds it where one answers
    ``device_id``'s want (``libs/weights/lending.py``; not over TLS; over ``streams``
    connections where the bucket holds the file's index), else from the bucket.
    ``progress(bytes, total)`` follows a fetch. Raises ``WeightsError`` naming the cause (no
    connection, not in the bucket, a digest that does not match)."""
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
    async with host_lock(target.with_suffix(".lock")):
        if not await asyncio.to_thread(
            holds, target, card.sha256, card.size_bytes, None, cache_dir
        ):
            if not (
                device_id is not None
                and isinstance(connection, NatsClient)
                and lending.lends(connection)
                and await _borrow(connection, device_id, card, target, progress, streams)
            ):
                await fetch(jetstream(connection), card, target, progress)
            mark_verified(target, card.sha256, cache_dir)
    return target


async def _borrow(
    nc: NatsClient,
    device_id: str,
    card: Card,
    target: Path,
    progress: Progress | None,
    streams: int | None,
) -> bool:
    """The file lent by a device (``borrowing.borrow``), checked chunk by chunk against the
    bucket's index of it where the bucket holds one, else hashed whole."""
    try:
        index = await read_index(jetstream(nc), card.sha256)
    except WeightsError as exc:  # an index that does not check out is not used
        log.warning("the weights index is not used: %s", exc)
        index = None
    return await borrowing.borrow(nc, device_id, card, target, progress, index, streams)


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
    if info.digest != object_digest(card.sha256) or info.size != card.size_bytes:
        raise WeightsError(f"the bucket's {card.sha256[:12]} is not {card.name}'s file")
    part, state_file = target.with_suffix(".gguf.part"), target.with_suffix(".gguf.part.json")
    state = read_json(state_file)
    same = state.get("nuid") == info.nuid
    done, digest = await asyncio.to_thread(
        bulk_fetch.resume, part, int(state["bytes"]) if same else 0
    )
    next_seq = int(state["seq"]) + 1 if done else 1
    if done:
        log.info("weights fetch resumed", extra={"sha256": card.sha256, "bytes": done})
    total = card.size_bytes
    with bulk_fetch.open_part(part, done) as file:
        if done < total:
            await _receive(js, info.nuid, next_seq, file, digest, done, total, state_file, progress)
    if digest.hexdigest() != card.sha256:
        part.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
        raise WeightsError(f"{card.name}'s fetched file does not hash to {card.sha256}: refused")
    part.replace(target)
    state_file.unlink(missing_ok=True)
    log.info("weights fetched", extra={"sha256": card.sha256, "bytes": total})


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
    """The object's chunks from stream sequence ``start_seq`` on, appended to ``file`` in
    order, how far it got written to ``state_file`` as it goes (so a cut fetch resumes).

    The chunks come by JetStream's direct get, ``bulk_fetch.BATCH`` at a time
    (``$JS.API.DIRECT.GET.<stream>``: the next messages of the object's chunk subject from a
    sequence on, then an end-of-batch status), onto an inbox of the connection's own user: no
    consumer is made, so a device's grant names no consumer API on the bucket (``MODEL_READ``),
    and none it could turn into a push consumer delivering the weights onto another subject.
    ``bulk_fetch`` reads them (a connection of the same user, its replies parsed lean, hashing
    on a thread of its own)."""
    try:
        await bulk_fetch.receive(
            client_of(js),
            STREAM,
            chunk_subject(nuid),
            start_seq,
            file,
            digest,
            done,
            total,
            state_file,
            {"nuid": nuid},
            progress,
            CHUNK_WAIT_S,
        )
    except bulk_fetch.BulkFetchError as exc:
        raise WeightsError(
            f"the {BUCKET} bucket's chunks stopped coming: {exc} "
            "(404: the object lost chunks; 503: no direct get on its stream)"
        ) from None
