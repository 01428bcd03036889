"""A small JSON file of a cluster's own (its users, its keys, its kept settings), written so
that no reader and no crash ever finds it half-written, readable by its owner only."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_private_json(path: Path, data: object) -> None:
    """``data`` as JSON in ``path`` (mode 0600), replaced whole: written beside it, then
    renamed over it."""
    part = path.with_name(f".{path.name}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)
        out.write(json.dumps(data, indent=2))
    part.replace(path)
