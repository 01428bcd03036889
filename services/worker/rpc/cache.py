"""llama.cpp's RPC tensor cache on this host, kept under a size limit.

``ggml-rpc-server -c`` keeps every tensor it receives (over 10 MiB: llama.cpp hashes only
those) as a file named by its hash under ``<LLAMA_CACHE>/rpc/``, so a head that places the same
model here again sends hashes instead of weights. llama.cpp never removes them; a device that
served many models would fill its disk. Before each RPC server starts, ``trim`` removes the
least recently used files until the folder holds at most the limit
(``TESSERA_WORKER_RPC_CACHE_GB``, 20 GB by default).
"""

from __future__ import annotations

import logging
from pathlib import Path

from libs.runtime.settings import model_cache_dir

log = logging.getLogger(__name__)


def rpc_cache_dir() -> Path:
    """Where this host's RPC servers keep the tensors they received (``<dir>/rpc/<hash>``)."""
    return model_cache_dir() / "llama-rpc"


def trim(folder: Path, max_bytes: int) -> tuple[int, int]:
    """Remove the least recently used (read or written) files under ``folder`` until the rest
    hold at most ``max_bytes``. Returns (files removed, bytes freed)."""
    entries = []
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        if path.is_file():
            entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    removed = freed = 0
    for _, size, path in sorted(entries, key=lambda e: (e[0], str(e[2]))):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total, removed, freed = total - size, removed + 1, freed + size
    if removed:
        log.info(
            "RPC cache %s: %d tensors removed (%.1f MB), %.1f MB kept",
            folder,
            removed,
            freed / 1e6,
            total / 1e6,
        )
    return removed, freed
