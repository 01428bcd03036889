"""The gateway's access log: one JSON line per API request, with the name of the key that made
it (never the key), its status and duration, appended to ``TESSERA_GATEWAY_ACCESS_LOG`` (a
cluster's home keeps it in ``logs/access.log``). Off when no file is given."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO


class AccessLog:
    def __init__(self, path: Path | None) -> None:
        self.file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", buffering=1)  # a line at a time: nothing half-written

    def write(
        self, method: str, path: str, key: str | None, status: int, started: float, client: str
    ) -> None:
        if self.file is None:
            return
        line = {
            "ts": round(time.time(), 3),
            "method": method,
            "path": path,
            "key": key or "-",
            "status": status,
            "seconds": round(time.monotonic() - started, 4),
            "client": client,
        }
        self.file.write(json.dumps(line) + "\n")
