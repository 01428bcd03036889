"""``python -m libs.models``: convert the shipped GGUF once and print the model folder."""

from __future__ import annotations

import logging
import sys

from libs.models.shipped import ModelMissing, prepare

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(prepare())
    except ModelMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
