"""Per-client request rates: a token bucket for each API key (or, with auth off, each address).

A client may send ``burst`` requests at once and ``rate`` per second on average; a request over
that is refused with 429 and told when to retry. Buckets of the least recently seen clients are
dropped past ``clients`` (a flood of new addresses cannot grow the gateway's memory); a dropped
client starts again with a full bucket. Pure: the clock is passed in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimiter:
    def __init__(
        self,
        rate: float,
        burst: int,
        clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate, self.burst, self.clients, self.clock = rate, float(burst), clients, clock
        #: client → (tokens left, when they were counted)
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, client: str) -> float:
        """Spend one request of ``client``'s: 0 when allowed, else seconds until it would be."""
        now = self.clock()
        tokens, then = self.buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self.buckets[client] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        while len(self.buckets) > self.clients:
            self.buckets.popitem(last=False)
        return wait
