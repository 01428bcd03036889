"""Automatic mode switching (seed 000 §3) with hysteresis.

The switcher keeps a baseline of cluster throughput and efficiency (tokens/J) — a slow moving
average of healthy observations. A throughput drop of 10 % or more from its baseline switches
to performance mode; an efficiency drop of 15 % or more switches to energy mode (throughput
wins if both). After an automatic switch nothing changes for ``dwell_s``; the mode returns to
balanced only once both metrics have recovered to within half their threshold of the
baselines held when the drop happened. A manual mode overrides all of this until cleared.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.contracts import Mode

THROUGHPUT_DROP = 0.10
EFFICIENCY_DROP = 0.15


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    mode: Mode
    previous: Mode
    reason: str
    manual: bool = False


@dataclass
class ModeSwitcher:
    mode: Mode = Mode.BALANCED
    dwell_s: float = 30.0
    smoothing: float = 0.1
    throughput_drop: float = THROUGHPUT_DROP
    efficiency_drop: float = EFFICIENCY_DROP
    manual: Mode | None = None
    baseline_throughput: float | None = None
    baseline_efficiency: float | None = None
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

    def observe(self, now: float, throughput: float, efficiency: float) -> ModeSwitch | None:
        """Feed one measurement (tokens/s, tokens/J); returns a switch when one happens."""
        if throughput < 0 or efficiency < 0:
            raise ValueError("throughput and efficiency must not be negative")
        if self.baseline_throughput is None or self.baseline_efficiency is None:
            self.baseline_throughput, self.baseline_efficiency = throughput, efficiency
            return None
        if self.manual is not None:
            return None
        t_drop = _drop(throughput, self.baseline_throughput)
        e_drop = _drop(efficiency, self.baseline_efficiency)
        if now - self.last_switch_at < self.dwell_s:
            return None
        if t_drop >= self.throughput_drop - 1e-12 and self.mode != Mode.PERFORMANCE:
            return self._switch(Mode.PERFORMANCE, now, f"throughput dropped {t_drop:.0%}")
        if (
            t_drop < self.throughput_drop - 1e-12
            and e_drop >= self.efficiency_drop - 1e-12
            and self.mode != Mode.ENERGY
        ):
            return self._switch(Mode.ENERGY, now, f"efficiency dropped {e_drop:.0%}")
        recovered = t_drop <= self.throughput_drop / 2 and e_drop <= self.efficiency_drop / 2
        if self.mode != Mode.BALANCED and recovered:
            return self._switch(Mode.BALANCED, now, "throughput and efficiency recovered")
        if self.mode == Mode.BALANCED and t_drop <= 0 and e_drop <= 0:
            # Only healthy (not-dropping) observations move the baseline up.
            a = self.smoothing
            self.baseline_throughput += a * (throughput - self.baseline_throughput)
            self.baseline_efficiency += a * (efficiency - self.baseline_efficiency)
        return None

    def _switch(self, mode: Mode, now: float, reason: str) -> ModeSwitch:
        previous, self.mode, self.last_switch_at = self.mode, mode, now
        return ModeSwitch(mode, previous, reason)


def _drop(value: float, baseline: float) -> float:
    return 0.0 if baseline <= 0 else max(0.0, 1.0 - value / baseline)
