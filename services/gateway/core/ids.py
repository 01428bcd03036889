"""Identifiers the gateway makes: a request's, a generation's, an answer's."""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    """``prefix`` and 24 random hex digits (``chatcmpl-…``, ``msg-…``)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
