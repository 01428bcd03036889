"""The gateway's API keys, kept in a cluster's home (``keys.json``), each by name and stored
hashed: the key itself is shown once, when it is made, and is never written anywhere.

A key is ``tsk-`` and 32 random bytes (URL-safe); its SHA-256 is what is kept (a random key of
that length needs no slow hash). The gateway reads the file (``TESSERA_GATEWAY_KEYS_FILE``)
and again whenever it changes, so a revoked key is refused without a restart.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from libs.runtime.private_files import write_private_json

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class StoredKey:
    name: str
    sha256: str
    created: float


def read_keys(path: Path) -> list[StoredKey]:
    """The keys in ``path`` (none when it is missing)."""
    if not path.exists():
        return []
    return [StoredKey(**entry) for entry in json.loads(path.read_text())["keys"]]


def _write(path: Path, keys: list[StoredKey]) -> None:
    write_private_json(path, {"keys": [asdict(k) for k in keys]})


def create_key(path: Path, name: str) -> str:
    """A new key named ``name``, stored hashed; the key (shown to the user once)."""
    if not NAME.match(name):
        raise ValueError(
            f"{name!r}: a key's name is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    keys = read_keys(path)
    if any(k.name == name for k in keys):
        raise ValueError(f"a key named {name!r} exists: revoke it first, or choose another name")
    key = f"tsk-{secrets.token_urlsafe(32)}"
    _write(path, [*keys, StoredKey(name, digest(key), time.time())])
    return key


def revoke_key(path: Path, name: str) -> bool:
    """Remove the key named ``name``; False when there is none."""
    keys = read_keys(path)
    kept = [k for k in keys if k.name != name]
    if len(kept) == len(keys):
        return False
    _write(path, kept)
    return True
