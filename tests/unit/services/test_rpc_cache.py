"""llama.cpp's RPC tensor cache stays under its limit, the least recently used going first."""

from __future__ import annotations

import os
from pathlib import Path

from services.worker.rpc.cache import trim


def tensor(folder: Path, name: str, size: int, used_s: float) -> Path:
    path = folder / "rpc" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    os.utime(path, (used_s, used_s))
    return path


def test_the_least_recently_used_tensors_go_until_the_cache_fits(tmp_path: Path) -> None:
    old = tensor(tmp_path, "aaa", 400, 1_000)
    read_lately = tensor(tmp_path, "bbb", 400, 1_000)
    os.utime(read_lately, (5_000, 1_000))  # read again after it was written: kept
    new = tensor(tmp_path, "ccc", 400, 3_000)
    assert trim(tmp_path, 900) == (1, 400)
    assert not old.exists() and read_lately.exists() and new.exists()
    # Under the limit nothing goes; a limit of 0 empties it; a missing folder is no error.
    assert trim(tmp_path, 800) == (0, 0)
    assert trim(tmp_path, 0) == (2, 800) and not any((tmp_path / "rpc").iterdir())
    assert trim(tmp_path / "absent", 0) == (0, 0)
