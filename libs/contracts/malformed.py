"""Malformed variants of contract messages, for fuzzing every consumer. Pure and seeded.

Each variant is built to fail its contract, whatever the draw: bytes that are not JSON, not
UTF-8, cut short, a JSON scalar where an object belongs, a required field removed or given a
value of the wrong type, nesting deeper than any parser takes, nothing at all. Binary frames
get their own: random bytes, cut short, a wrong magic. A consumer must refuse each one, count
it by reason, and carry on.
"""

from __future__ import annotations

import json
import random

from pydantic import BaseModel

KINDS = ("bytes", "not_utf8", "truncated", "scalar", "wrong_type", "missing", "deep", "empty")
FRAME_KINDS = ("bytes", "truncated", "bad_magic", "empty")
WRONG = [[{"not": "this"}]]  #: a value no field of any contract accepts


def malformed(model: type[BaseModel], valid: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One invalid payload for ``model`` (``valid`` is a good one to start from)."""
    kind = rng.choice(KINDS)
    if kind == "bytes":
        return kind, b"\x00" + rng.randbytes(rng.randint(0, 256))
    if kind == "not_utf8":
        return kind, b"\xff\xfe" + valid
    if kind == "truncated":
        return kind, valid[: rng.randint(0, len(valid) - 1)]
    if kind == "scalar":
        return kind, rng.choice([b"null", b"[]", b"42", b'"text"', b"true", b"-1e999"])
    if kind == "deep":
        depth = rng.randint(2_000, 20_000)
        return kind, b"[" * depth + b"]" * depth
    if kind == "empty":
        return kind, b""
    data = json.loads(valid)
    required = [n for n, f in model.model_fields.items() if f.is_required() and n in data]
    field = rng.choice(required)
    if kind == "missing":
        del data[field]
    else:
        data[field] = WRONG
    return kind, json.dumps(data).encode()


def malformed_frame(valid: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One invalid binary frame (``valid`` is a good encoded frame)."""
    kind = rng.choice(FRAME_KINDS)
    if kind == "bytes":
        return kind, b"\x00" + rng.randbytes(rng.randint(0, 512))
    if kind == "truncated":
        return kind, valid[: rng.randint(0, len(valid) - 1)]
    if kind == "bad_magic":
        return kind, b"NOPE" + valid[4:]  # not the frame magic
    return kind, b""
