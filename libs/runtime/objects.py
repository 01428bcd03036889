"""Reading an object from a JetStream object store as a device may: naming its stream.

nats-py's ``ObjectStore.get`` finds the stream of an object's chunks by asking the server for
the names of the streams that hold a subject (``$JS.API.STREAM.NAMES``); a device's NATS user
may not list streams (``libs/cluster/access.py``: ``MODEL_READ``), so this reads the same
object through the same ordered consumer with the stream named, and checks its digest.
"""

from __future__ import annotations

import base64
import hashlib

from nats.js.client import JetStreamContext
from nats.js.errors import DigestMismatchError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE


async def read_object(js: JetStreamContext, bucket: str, name: str) -> bytes:
    """The bytes of object ``name`` in ``bucket``. Raises ``ObjectNotFoundError`` when there
    is none, ``DigestMismatchError`` when what arrived is not what was stored."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if not info.size:
        return b""
    chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    sub = await js.subscribe(chunks, ordered_consumer=True, stream=stream)
    data = bytearray()
    try:
        async for msg in sub.messages:
            data += msg.data
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    digest = (info.digest or "").split("=", 1)[-1]
    if hashlib.sha256(data).digest() != base64.urlsafe_b64decode(digest):
        raise DigestMismatchError
    return bytes(data)
