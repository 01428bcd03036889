"""Binary frames that carry hidden states from shard to shard (not JSON: raw little-endian floats).

Layout (all little-endian)::

    magic "TSF1" | kind u8 | flags u8 | dtype u8 | ndim u8 | epoch u32 | position u32 |
    token u32 | meta_len u32 | data_len u32 | id_len u16 | request_id | shape u32×ndim |
    meta | data

Between shards every frame is a ``STEP``: the rows of one batched step of several requests
(``meta``: a JSON list of ``StepRow``, each naming its request, what its rows are — PREFILL,
DECODE, TOKEN, END — and how many of ``data``'s rows are its own). ``kind`` is what the frame
does (see ``FrameKind``); ``position`` is the sequence position of
the first row of ``data``; ``token`` is a sampled token id (``TOKEN`` frames only); ``meta`` is
the ``GenerationRequest`` JSON on the first prefill chunk (later shards need its sampling and
the tokens already streamed) and empty otherwise. A frame is at most ``MAX_MESSAGE_BYTES``:
prompts are sent as several prefill chunks.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum

from pydantic import TypeAdapter, ValidationError

from libs.contracts.base import TOKEN_PATTERN
from libs.contracts.errors import ContractError
from libs.contracts.generation import StepRow

MAGIC = b"TSF1"
_HEAD = struct.Struct("<4sBBBBIIIIIH")
#: Bytes per element of each dtype code.
DTYPES = {"float32": (1, 4), "bfloat16": (2, 2), "float16": (3, 2), "int32": (4, 4)}
_BY_CODE = {code: (name, size) for name, (code, size) in DTYPES.items()}
_NO_DTYPE = 0
MAX_FRAME_BYTES = 1024 * 1024
MAX_NDIM = 4
_ID = re.compile(TOKEN_PATTERN)
_STEP_ROWS = TypeAdapter(list[StepRow])


class FrameKind(IntEnum):
    PREFILL = 1  #: hidden states of prompt rows; FINAL on the prompt's last chunk
    DECODE = 2  #: hidden state of the one newest token
    TOKEN = 3  #: the last shard's sampled token, sent back to the first shard
    END = 4  #: the request is over: free its KV cache (meta: the reason)
    STEP = 5  #: one batched step: ``meta`` lists its ``StepRow``s, ``data`` stacks their rows


FINAL = 0x01


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    request_id: str
    epoch: int
    position: int = 0
    token: int = 0
    flags: int = 0
    meta: bytes = b""
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    data: bytes = b""

    @property
    def final(self) -> bool:
        return bool(self.flags & FINAL)

    def encode(self) -> bytes:
        rid = self.request_id.encode()
        code = _NO_DTYPE if self.dtype is None else DTYPES[self.dtype][0]
        _check_data(self.dtype, self.shape, len(self.data))
        head = _HEAD.pack(
            MAGIC,
            int(self.kind),
            self.flags,
            code,
            len(self.shape),
            self.epoch,
            self.position,
            self.token,
            len(self.meta),
            len(self.data),
            len(rid),
        )
        dims = struct.pack(f"<{len(self.shape)}I", *self.shape)
        out = b"".join((head, rid, dims, self.meta, self.data))
        if len(out) > MAX_FRAME_BYTES:
            raise ContractError("too_large", f"frame of {len(out)} bytes > {MAX_FRAME_BYTES}")
        return out


def decode_frame(raw: bytes) -> Frame:
    """Parse one frame; raises ``ContractError`` naming what is wrong."""
    if len(raw) > MAX_FRAME_BYTES:
        raise ContractError("too_large", f"frame of {len(raw)} bytes > {MAX_FRAME_BYTES}")
    if len(raw) < _HEAD.size:
        raise ContractError("malformed_frame", f"{len(raw)} bytes is shorter than a header")
    magic, kind, flags, code, ndim, epoch, position, token, meta_len, data_len, id_len = (
        _HEAD.unpack_from(raw)
    )
    if magic != MAGIC:
        raise ContractError("malformed_frame", f"magic {magic!r} is not {MAGIC!r}")
    if kind not in FrameKind._value2member_map_:
        raise ContractError("malformed_frame", f"unknown frame kind {kind}")
    if ndim > MAX_NDIM:
        raise ContractError("malformed_frame", f"{ndim} dimensions > {MAX_NDIM}")
    if code != _NO_DTYPE and code not in _BY_CODE:
        raise ContractError("malformed_frame", f"unknown dtype code {code}")
    expected = _HEAD.size + id_len + 4 * ndim + meta_len + data_len
    if expected != len(raw):
        raise ContractError("malformed_frame", f"lengths add to {expected}, frame is {len(raw)}")
    at = _HEAD.size
    try:
        request_id = raw[at : at + id_len].decode()
    except UnicodeDecodeError:
        raise ContractError("malformed_frame", "request_id is not UTF-8") from None
    if not _valid_id(request_id):
        raise ContractError("malformed_frame", f"request_id {request_id!r} is not a valid id")
    at += id_len
    shape = struct.unpack_from(f"<{ndim}I", raw, at)
    at += 4 * ndim
    meta = raw[at : at + meta_len]
    data = raw[at + meta_len :]
    dtype = None if code == _NO_DTYPE else _BY_CODE[code][0]
    _check_data(dtype, shape, len(data))
    return Frame(
        FrameKind(kind), request_id, epoch, position, token, flags, meta, dtype, shape, data
    )


def _check_data(dtype: str | None, shape: tuple[int, ...], size: int) -> None:
    if dtype is None:
        if shape or size:
            raise ContractError("malformed_frame", "data without a dtype")
        return
    count = 1
    for dim in shape:
        count *= dim
    if count * DTYPES[dtype][1] != size:
        raise ContractError("malformed_frame", f"shape {shape} of {dtype} is not {size} bytes")


def _valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def step_rows(frame: Frame) -> list[StepRow]:
    """The rows a ``STEP`` frame carries, checked against its data; raises ``ContractError``."""
    if frame.kind != FrameKind.STEP:
        raise ContractError("malformed_frame", f"a {frame.kind.name} frame where a STEP belongs")
    try:
        rows = _STEP_ROWS.validate_json(frame.meta)
    except ValidationError as exc:
        raise ContractError("malformed_frame", f"step rows: {exc}") from None
    count = sum(r.rows for r in rows)
    if count != (frame.shape[0] if frame.shape else 0):
        raise ContractError("malformed_frame", f"rows add to {count}, data has {frame.shape}")
    return rows


def step_frame(
    epoch: int, rows: list[StepRow], data: bytes = b"", shape: tuple[int, ...] = ()
) -> Frame:
    """A ``STEP`` frame of ``rows`` (float32 ``data`` of ``shape`` when they carry states)."""
    meta = _STEP_ROWS.dump_json(rows, exclude_none=True)
    dtype = "float32" if shape else None
    return Frame(
        FrameKind.STEP, rows[0].request_id, epoch, meta=meta, dtype=dtype, shape=shape, data=data
    )
