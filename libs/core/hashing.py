"""Stable hashing and the consistent-hash ring (with virtual nodes)."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence


def stable_hash(key: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Each node owns ``replicas`` points on a 64-bit ring; a key goes to the next point.

    Adding or removing one of n nodes moves about 1/n of the keys.
    """

    def __init__(self, nodes: Sequence[str], replicas: int = 160) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        points = sorted(
            (stable_hash(f"{node}#{r}"), node) for node in nodes for r in range(replicas)
        )
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes in ring order from ``key``'s position (lazily: usually one step)."""
        if not self._hashes:
            return
        start = bisect.bisect(self._hashes, stable_hash(key)) % len(self._hashes)
        seen: set[str] = set()
        for offset in range(len(self._nodes)):
            node = self._nodes[(start + offset) % len(self._nodes)]
            if node not in seen:
                seen.add(node)
                yield node

    def lookup(self, key: str) -> str | None:
        if not self._hashes:
            return None
        start = bisect.bisect(self._hashes, stable_hash(key)) % len(self._hashes)
        return self._nodes[start]
