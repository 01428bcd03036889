"""Automatic mode switching with hysteresis, on performance per unit of demand.

The first design switches to performance mode when performance drops by more than 10 % and to
energy mode when efficiency drops by more than 15 %. A cluster's absolute throughput is not its
performance: it falls whenever fewer requests come (an idle cluster after a burst "dropped"
94 %, and was switched to performance mode for nothing). So the switcher reads each
observation against the demand it was measured under:

* ``busy`` is the number of requests the cluster was serving (busy slots). Below
  ``IDLE_BUSY`` the cluster is idle: the observation says nothing about performance, and the
  mode and the baselines stay as they are.
* Performance is tokens/s per busy slot; efficiency is tokens/J. Both are compared only at
  comparable load: each load band (busy slots within a factor of 2: 1, 2–3, 4–7, ...) keeps its
  own baselines, since batching raises tokens/s and idle power lowers tokens/J at low load.
* An observation counts only when the one before it was in the same band: the rates are
  measured over a window (the workers' last 10 s), and across a change of load the window
  still holds the old load's tokens.

A baseline is a slow moving average of healthy observations in its band (set by the band's
first counted observation; only rising, in balanced mode). A drop of ``throughput_drop``
(10 %) or more in performance switches to performance mode; of ``efficiency_drop`` (15 %) or
more in efficiency, to energy mode (performance wins if both). After an automatic switch
nothing changes for ``dwell_s``; the mode returns to balanced only once both have recovered
to within half their threshold of the band's baselines. A manual mode overrides all of this
until cleared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.contracts import Mode, TelemetrySample

THROUGHPUT_DROP = 0.10
EFFICIENCY_DROP = 0.15
#: Fewer busy slots than this (on average over the measurement): the cluster is idle.
IDLE_BUSY = 0.5


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    mode: Mode
    previous: Mode
    reason: str
    manual: bool = False


def cluster_busy(samples: Iterable[TelemetrySample]) -> float:
    """The busy slots behind a cluster's rates: the requests its live devices report serving
    or queued (each sample's ``queue_depth``: a served worker's requests in flight, a torch
    worker's steps waiting)."""
    return float(sum(sample.queue_depth for sample in samples))


def load_band(busy: float) -> int:
    """The load band of ``busy`` slots: 0 for [1, 2), 1 for [2, 4), -1 for [0.5, 1), ..."""
    return math.floor(math.log2(busy))


@dataclass
class ModeSwitcher:
    mode: Mode = Mode.BALANCED
    dwell_s: float = 30.0
    smoothing: float = 0.1
    throughput_drop: float = THROUGHPUT_DROP
    efficiency_drop: float = EFFICIENCY_DROP
    manual: Mode | None = None
    #: Per load band: (tokens/s per busy slot, tokens/J) of healthy observations.
    baselines: dict[int, tuple[float, float]] = field(default_factory=dict)
    last_band: int | None = None
    last_switch_at: float = float("-inf")

    def override(self, mode: Mode | None, now: float) -> ModeSwitch | None:
        """Set (or with None, clear) a manual mode."""
        previous = self.mode
        self.manual = mode
        if mode is None:
            return None
        self.mode = mode
        self.last_switch_at = now
        return ModeSwitch(mode, previous, "manual override", manual=True)

    def observe(
        self, now: float, throughput: float, efficiency: float, busy: float
    ) -> ModeSwitch | None:
        """Feed one measurement: cluster tokens/s and tokens/J, and the busy slots (requests
        being served) they were measured under. Returns a switch when one happens."""
        if throughput < 0 or efficiency < 0 or busy < 0:
            raise ValueError("throughput, efficiency and busy must not be negative")
        if busy < IDLE_BUSY:  # idle: no demand, so nothing to read about performance
            self.last_band = None
            return None
        band, previous_band = load_band(busy), self.last_band
        self.last_band = band
        if band != previous_band:  # the load changed: the rates' window spans two loads
            return None
        performance = throughput / busy
        if band not in self.baselines:
            self.baselines[band] = (performance, efficiency)
            return None
        if self.manual is not None:
            return None
        base_performance, base_efficiency = self.baselines[band]
        t_drop = _drop(performance, base_performance)
        e_drop = _drop(efficiency, base_efficiency)
        if now - self.last_switch_at < self.dwell_s:
            return None
        if t_drop >= self.throughput_drop - 1e-12 and self.mode != Mode.PERFORMANCE:
            return self._switch(
                Mode.PERFORMANCE, now, f"tokens/s per busy slot dropped {t_drop:.0%}"
            )
        if (
            t_drop < self.throughput_drop - 1e-12
            and e_drop >= self.efficiency_drop - 1e-12
            and self.mode != Mode.ENERGY
        ):
            return self._switch(Mode.ENERGY, now, f"efficiency dropped {e_drop:.0%}")
        recovered = t_drop <= self.throughput_drop / 2 and e_drop <= self.efficiency_drop / 2
        if self.mode != Mode.BALANCED and recovered:
            return self._switch(Mode.BALANCED, now, "performance and efficiency recovered")
        if self.mode == Mode.BALANCED and t_drop <= 0 and e_drop <= 0:
            # Only healthy (not-dropping) observations move the baseline up.
            a = self.smoothing
            self.baselines[band] = (
                base_performance + a * (performance - base_performance),
                base_efficiency + a * (efficiency - base_efficiency),
            )
        return None

    def _switch(self, mode: Mode, now: float, reason: str) -> ModeSwitch:
        previous, self.mode, self.last_switch_at = self.mode, mode, now
        return ModeSwitch(mode, previous, reason)


def _drop(value: float, baseline: float) -> float:
    return 0.0 if baseline <= 0 else max(0.0, 1.0 - value / baseline)
