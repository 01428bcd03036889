"""The live batch policies in the simulator: what ``edf``, ``fifo``, ``elasticflow`` and
``edgeflow`` should make of a mix of arriving batches, on the same code the gateway's runner
runs (``libs/core/batch_policies.py``: admission, shares, EdgeFlow's edge and its rescue of a
cloud batch whose plan turns late), with the measured
throughput curves in place of the devices. ``bench/jobs_live.py`` prints it beside what the
live cluster did with the same mix.

Requests run in waves, as the runner sends them: a batch sends its share of the streams at
once, and each request makes its part of the rate measured at all the requests in flight
beside it, and ends when it has made what a request makes on average (``Arrival.made``, as
measured: a chat answer stops before its ``max_tokens``; admission plans for all of them, as
the runner does). What it leaves out: interactive chat (the mix has none), a request's prompt
and start, that requests of a wave differ in length, and the gateway's own time. Pure: time
is simulated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.core.batch_policies import Batch, Lane, admit_batch, edge_lane, rescued, shares


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    requests: int
    #: The most units (tokens) one request may make (what admission plans for).
    most: int
    window_s: float
    #: What one makes on average (a chat request stops at its answer's end, most before
    #: ``most``); None: ``most``.
    made: float | None = None


@dataclass
class Running:
    """An admitted batch: requests not answered, and the wave in flight (requests sent at
    once, tokens each has made): a request is answered when it has made ``most``."""

    arrival: Arrival
    job_id: str
    lane: str
    requests_left: int
    in_wave: int = 0
    made: float = 0.0
    ended_s: float = math.nan

    def view(self, rates: Mapping[int, float]) -> Batch:
        a = self.arrival
        return Batch(self.job_id, self.requests_left, a.most, a.at_s + a.window_s, a.at_s, rates)

    def step(self, per_request: float) -> None:
        """Each request of the wave makes ``per_request`` more units; the wave is answered
        once each has made what a request makes."""
        self.made += per_request
        made = self.arrival.made if self.arrival.made is not None else self.arrival.most
        if self.in_wave and self.made >= made - 1e-9:  # answered at this step's end
            self.requests_left -= self.in_wave
            self.in_wave, self.made = 0, 0.0


@dataclass
class Outcome:
    declined: int = 0
    admitted: int = 0
    met: int = 0
    #: Per arrival: "declined", "met" or "late", and on which lane ("" is the cloud).
    each: list[tuple[str, str]] = field(default_factory=list)
    #: Per arrival: seconds from its arrival to its end (nan: declined).
    took_s: list[float] = field(default_factory=list)

    @property
    def deadlines_met(self) -> float | None:
        return round(self.met / self.admitted, 3) if self.admitted else None


def rate_at(rates: Mapping[int, float], streams: int) -> float:
    """Units/s at ``streams`` at once: the measured point at or below it (scaled up from the
    fewest measured where none is below)."""
    below = [k for k in rates if k <= streams]
    if below:
        return rates[max(below)]
    fewest = min(rates)
    return rates[fewest] * streams / fewest


@dataclass(frozen=True)
class Mix:
    """What the runner runs batches on: ``policy``, ``streams`` requests at once in the cloud
    at ``rates`` (units/s by requests at once) and, for ``edgeflow``, edge ``lanes``
    (deployment → its rates)."""

    policy: str
    rates: Mapping[int, float]
    streams: int
    lanes: Mapping[str, Mapping[int, float]]

    def admit(
        self, arrival: Arrival, job_id: str, live: list[Running], now: float
    ) -> Running | None:
        """The arrival admitted (on the cloud, or an edge lane) or None, as the gateway
        decides."""
        running = Running(arrival, job_id, "", arrival.requests)
        new = running.view(self.rates)
        active = [r for r in live if math.isnan(r.ended_s)]
        cloud = [r.view(self.rates) for r in active if not r.lane]
        if admit_batch(self.policy, cloud, new, now, self.streams).admitted:
            return running
        if self.policy != "edgeflow":
            return None
        busy = {r.lane for r in active if r.lane}
        idle = [Lane(d, r) for d, r in self.lanes.items() if d not in busy]
        taken = edge_lane(new, idle, now, self.streams)
        if taken is None:
            return None
        running.lane = taken[0]
        return running

    def work(self, running: list[Running], now: float, step_s: float) -> None:
        """One step: a batch with no wave in flight sends its share of the cloud's streams
        (an edge lane's batch: all of its lane's) as one wave; each request in flight makes
        its part of the rate measured at all the requests in flight beside it (the cloud's,
        or its lane's)."""
        if self.policy == "edgeflow":
            self.rescue(running, now)
        cloud = [r for r in running if not r.lane]
        share = shares(self.policy, [r.view(self.rates) for r in cloud], now, self.streams)
        for r in running:
            if r.in_wave == 0:
                room = self.streams - sum(c.in_wave for c in cloud) if not r.lane else self.streams
                give = share.get(r.job_id, 0) if not r.lane else self.streams
                r.in_wave = max(0, min(give, room, r.requests_left))
        used = sum(r.in_wave for r in cloud)
        for r in running:
            if r.in_wave == 0:
                continue
            at_once = r.in_wave if r.lane else used
            total = rate_at(self.lanes[r.lane] if r.lane else self.rates, at_once)
            r.step(total / at_once * step_s)

    def rescue(self, running: list[Running], now: float) -> None:
        """EdgeFlow's rules 2 and 3 made safe, as the runner runs them each step: a cloud
        batch the plan now ends late moves to an idle lane that ends it in time (here once its
        wave in flight, if any, is answered)."""
        busy = {r.lane for r in running if r.lane}
        idle = [Lane(d, r) for d, r in self.lanes.items() if d not in busy]
        cloud = [r for r in running if not r.lane]
        free = {r.job_id: idle for r in cloud if r.in_wave == 0}
        moved = rescued([r.view(self.rates) for r in cloud], free, now, self.streams)
        for r in cloud:
            r.lane = moved.get(r.job_id, "")


def simulate(
    policy: str,
    arrivals: Sequence[Arrival],
    rates: Mapping[int, float],
    streams: int,
    lanes: Mapping[str, Mapping[int, float]] | None = None,
    step_s: float = 0.1,
) -> Outcome:
    """Run ``arrivals`` under ``policy`` with ``streams`` requests at once in the cloud at
    ``rates`` (units/s by requests at once) and, for ``edgeflow``, edge ``lanes`` (deployment
    → its rates)."""
    mix = Mix(policy, rates, streams, lanes or {})
    out, live = Outcome(), list[Running]()
    pending = sorted(arrivals, key=lambda a: a.at_s)
    now, index = 0.0, 0
    while index < len(pending) or any(math.isnan(r.ended_s) for r in live):
        while index < len(pending) and pending[index].at_s <= now + 1e-9:
            index += 1
            running = mix.admit(pending[index - 1], f"b{index}", live, now)
            if running is None:
                out.declined += 1
            else:
                out.admitted += 1
                live.append(running)
        mix.work([r for r in live if math.isnan(r.ended_s)], now, step_s)
        now += step_s
        for r in live:
            if math.isnan(r.ended_s) and r.requests_left <= 0:
                r.ended_s = now
    ran = {id(r.arrival): r for r in live}
    for arrival in arrivals:
        this = ran.get(id(arrival))
        out.took_s.append(math.nan if this is None else this.ended_s - arrival.at_s)
        if this is None:
            out.each.append(("declined", ""))
            continue
        met = this.ended_s <= arrival.at_s + arrival.window_s + 1e-9
        out.met += met
        out.each.append(("met" if met else "late", this.lane))
    return out
