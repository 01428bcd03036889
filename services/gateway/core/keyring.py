"""The API keys the gateway accepts: those of ``TESSERA_GATEWAY_API_KEYS`` (given whole, in its
environment) and those of ``TESSERA_GATEWAY_KEYS_FILE`` (a cluster home's ``keys.json``: names
and SHA-256 digests, ``libs/runtime/api_keys.py``), read again when the file changes, so a key
revoked with ``tessera keys revoke`` is refused from the next request on."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from libs.runtime.api_keys import digest, read_keys

#: How often the file's change time is looked at (a revocation takes effect within this).
RECHECK_S = 1.0


class KeyRing:
    def __init__(
        self, given: list[str], path: Path | None, internal: dict[str, str] | None = None
    ) -> None:
        #: (name, SHA-256 digest) of every key; the given ones are named by their place.
        self.given = [(f"env-{i}", digest(k)) for i, k in enumerate(given)]
        #: The gateway's own (its batch runner's, by name), accepted whether or not keys are
        #: required.
        self.internal = [(name, digest(k)) for name, k in (internal or {}).items()]
        self.path = path
        self.stored: list[tuple[str, str]] = []
        self._seen: float | None = None
        self._checked = 0.0
        self._reload()

    def _reload(self) -> None:
        if self.path is None:
            return
        try:
            changed = os.stat(self.path).st_mtime_ns / 1e9
        except FileNotFoundError:
            changed = -1.0
        if changed == self._seen:
            return
        self._seen = changed
        self.stored = [(k.name, k.sha256) for k in read_keys(self.path)]

    @property
    def required(self) -> bool:
        """Whether any key exists (none: the gateway runs open, as it was told to)."""
        return bool(self.given or self.path is not None)

    def name_of(self, key: str) -> str | None:
        """The name of ``key`` when it is accepted, else None."""
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            self._reload()
        presented = digest(key)
        found = None
        for name, held in [*self.given, *self.stored, *self.internal]:  # all compared
            if secrets.compare_digest(presented, held):
                found = name
        return found
