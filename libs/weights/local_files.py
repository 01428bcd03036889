"""What of a model's weights this host holds: the cache's layout (fetched files under their
sha256) and which files are known to hash to a model's sha256.

Hashing a gigabyte takes seconds, so a file once verified gets a marker (its path, size,
modification time and inode): the next check reads the marker, not the file. Where the cache
cannot be written (a container's, root's), the file is hashed again next time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from libs.models.gguf_info import sha256_of
from libs.runtime.settings import model_cache_dir

log = logging.getLogger(__name__)


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
    known = read_json(marker)
    known[str(path.resolve())] = _stamp(path)
    tmp = marker.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(marker)


def read_json(marker: Path) -> dict[str, Any]:
    """A JSON object's file as a dict; {} where it is missing or not one."""
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(marker.read_text())
        if isinstance(known, dict):
            return known
    return {}


def holds(
    path: Path,
    sha256: str,
    size_bytes: int,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: Path | None = None,
) -> bool:
    """Whether ``path`` is this model's file: its size, then its digest (from the marker while
    the file is unchanged since it was verified, else hashed once and marked)."""
    try:
        if not path.is_file() or path.stat().st_size != size_bytes:
            return False
        if read_json(_marker(sha256, cache_dir)).get(str(path.resolve())) == _stamp(path):
            return True
        if sha256_of(path, progress) != sha256:
            return False
    except OSError:
        return False
    try:
        mark_verified(path, sha256, cache_dir)
    except OSError as exc:  # a read-only cache (a container's): hashed again next time
        log.info("could not remember that %s is verified: %s", path, exc)
    return True


def verified_path(sha256: str, size_bytes: int, cache_dir: Path | None = None) -> Path | None:
    """A file of this host known to hash to ``sha256`` and unchanged since (its marker's
    stamp): the model's source where it was added or loaded, or its copy in the cache."""
    for name, stamp in read_json(_marker(sha256, cache_dir)).items():
        path = Path(name)
        with contextlib.suppress(OSError):
            if stamp == _stamp(path) and stamp[0] == size_bytes:
                return path
    return None
