"""What each deployment's requests measured: the gateway times every generation, and sends
each deployment's figures to the scheduler (``DEPLOYMENT_MEASURED``), which records them beside
its prediction and corrects its model by them (``services/scheduler/speeds.py``).

A request is counted at the most requests of its deployment that were in flight at once while
it ran (its ``streams``): one that ran alone gives the tokens/s at one stream and the time to
a first token; one that ran beside seven or more others gives the aggregate at eight (its own
decode rate times its streams). Its decode rate is its tokens after the first over the time
from the first to the last; a request of fewer than ``MIN_TOKENS`` tokens says too little.
The figures are the medians of the last ``WINDOW`` requests of the deployment's current plan
(a new epoch starts them over: another placement is another speed).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from libs.contracts import DeploymentMeasured, Speed

#: Requests kept per deployment; fewest tokens a request must stream to be counted.
WINDOW, MIN_TOKENS = 32, 8
#: Seconds between two sendings of one deployment's figures (while it has new ones).
SEND_EVERY_S = 5.0


@dataclass(slots=True)
class Timed:
    """One request: the most requests of its deployment in flight beside it (itself
    counted), its decode rate and its time to a first token."""

    streams: int
    tokens_per_s: float
    ttft_s: float


@dataclass(slots=True)
class Running:
    """A request in flight: its deployment and the most of its requests in flight so far."""

    deployment_id: str
    epoch: int | None
    streams: int = 1


@dataclass
class Speeds:
    #: Requests in flight, by deployment.
    running: dict[str, list[Running]] = field(default_factory=dict)
    #: The last ``WINDOW`` requests measured, by deployment, and the epoch they ran under.
    seen: dict[str, deque[Timed]] = field(default_factory=dict)
    epochs: dict[str, int | None] = field(default_factory=dict)
    #: Deployments measured since their figures were last sent.
    fresh: set[str] = field(default_factory=set)

    def began(self, deployment_id: str, epoch: int | None) -> Running:
        """A request of ``deployment_id`` (its plan's ``epoch``) starts: every request of it
        in flight now ran beside as many."""
        others = self.running.setdefault(deployment_id, [])
        run = Running(deployment_id, epoch)
        others.append(run)
        for r in others:
            r.streams = max(r.streams, len(others))
        return run

    def ended(
        self,
        run: Running,
        tokens: int,
        first_s: float | None,
        last_s: float | None,
        started_s: float,
        epoch: int | None,
    ) -> None:
        """``run`` ended after ``tokens`` tokens, the first at ``first_s`` and the last at
        ``last_s`` (``started_s`` its start, one clock); ``epoch``: its deployment's plan now
        (a request that outlived its plan measured two placements and is not counted)."""
        runs = self.running.get(run.deployment_id, [])
        if run in runs:
            runs.remove(run)
        if tokens < MIN_TOKENS or first_s is None or last_s is None or last_s <= first_s:
            return
        if epoch != run.epoch:
            return
        key = run.deployment_id
        if self.epochs.get(key, epoch) != epoch or key not in self.seen:
            self.seen[key] = deque(maxlen=WINDOW)
        self.epochs[key] = epoch
        rate = (tokens - 1) / (last_s - first_s)
        self.seen[key].append(Timed(run.streams, rate, first_s - started_s))
        self.fresh.add(key)

    def measured(self, deployment_id: str) -> tuple[Speed, int] | None:
        """The deployment's figures and how many requests they come from; None until one
        request ran alone."""
        seen = self.seen.get(deployment_id, ())
        alone = [t for t in seen if t.streams == 1]
        if not alone:
            return None
        crowded = [t.streams * t.tokens_per_s for t in seen if t.streams >= 8]
        speed = Speed(
            tokens_per_s_1=round(statistics.median(t.tokens_per_s for t in alone), 2),
            tokens_per_s_8=round(statistics.median(crowded), 2) if crowded else None,
            ttft_ms=round(statistics.median(t.ttft_s for t in alone) * 1000.0, 1),
        )
        return speed, len(alone) + len(crowded)

    def keep_only(self, live: Collection[str]) -> None:
        """Forget the figures of every deployment not in ``live`` and with no request in
        flight: one that was removed is measured no more."""
        for gone in (set(self.seen) | set(self.running)) - set(live):
            if not self.running.get(gone):
                for held in (self.seen, self.epochs, self.running):
                    held.pop(gone, None)
                self.fresh.discard(gone)

    async def send(
        self,
        publish: Callable[[DeploymentMeasured], Awaitable[None]],
        live: Collection[str] | None = None,
    ) -> None:
        """Each deployment measured since the last sending, as ``DeploymentMeasured``;
        ``live``: the deployments there are now (the others are forgotten first)."""
        if live is not None:
            self.keep_only(live)
        fresh, self.fresh = self.fresh, set()
        for deployment_id in sorted(fresh):
            figures, epoch = self.measured(deployment_id), self.epochs.get(deployment_id)
            if figures is None or epoch is None:
                continue
            speed, requests = figures
            await publish(
                DeploymentMeasured(
                    deployment_id=deployment_id, epoch=epoch, measured=speed, requests=requests
                )
            )
