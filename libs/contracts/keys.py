"""The Redis key layout shared by the scorer (writer), the scheduler and the CLI (readers).

* ``{p}:dev:{id}``      hash: class, state, raw (the latest sample as JSON), each dimension,
                        total, scored_at, mode;
                        expires when the device stays silent.
* ``{p}:caps:{id}``     the device's announce (JSON), so a restarted scorer knows it.
* ``{p}:hist:{id}``     hash: first_seen, down_s, failures (stability history).
* ``{p}:rank:{dim}``    sorted set per dimension and ``total``: top-k in one ZREVRANGE.
* ``{p}:failed``        set of failed device ids.
* ``{p}:mode``          the active scheduling mode.
* ``{p}:stats``         hash of counters: processed, rejected:<reason>.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "tessera"

    def device(self, device_id: str) -> str:
        return f"{self.prefix}:dev:{device_id}"

    def caps(self, device_id: str) -> str:
        return f"{self.prefix}:caps:{device_id}"

    def history(self, device_id: str) -> str:
        return f"{self.prefix}:hist:{device_id}"

    def rank(self, dimension: str) -> str:
        return f"{self.prefix}:rank:{dimension}"

    @property
    def failed(self) -> str:
        return f"{self.prefix}:failed"

    @property
    def mode(self) -> str:
        return f"{self.prefix}:mode"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats"
