"""Energy-aware formulas: power budget, heat, battery, DVFS hints, and the
device power physics the emulated devices, the simulator and the energy mode share.

Power of a device at clock share f, busy a share ``busy`` of the time: idle + (max − idle) ×
busy × f³ (dynamic power goes with f·V², and the voltage with f), so at a lower clock one
token costs f² of the dynamic energy while taking 1/f of the time. A device given no work for
``SLEEP_AFTER_S`` falls to ``SLEEP_SHARE`` of its idle power and takes ``WAKE_S`` to wake.

Each function works on floats or numpy arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from libs.contracts import TelemetrySample
from libs.core.capability import Num

#: Throttle temperatures (°C): mobile devices and desktops/servers.
MOBILE_LIMIT_C = 85.0
DESKTOP_LIMIT_C = 95.0
#: Below this battery level (fraction) a device's weight shrinks proportionally.
BATTERY_THRESHOLD = 0.20
#: An unplugged device below this level (fraction) takes no new work at all.
BATTERY_FLOOR = 0.05
#: Within this many degrees of the limit, a device's score backs off linearly toward 0.
THERMAL_BACKOFF_C = 10.0
#: Fixed overhead a task adds on top of its compute power, as a share of the dynamic range.
TASK_OVERHEAD_SHARE = 0.01
#: A device with no work this long sleeps (suspend, deep C-states, a phone's screen-off idle).
SLEEP_AFTER_S = 30.0
#: Idle power as a share of typical power: an emulated device's, and the scheduler's model of
#: a device that does not report its own.
IDLE_SHARE = 0.25
#: Sleep power as a share of idle power.
SLEEP_SHARE = 0.1
#: Seconds a sleeping device takes before it serves new work.
WAKE_S = 1.0
#: How long energy mode lets a device without work stay awake: waking costs WAKE_S of idle
#: power, and each second asleep saves (1 − SLEEP_SHARE) of it, so sleeping after this long
#: (the break-even time) never spends more than twice what knowing the next request's arrival
#: would have (the ski-rental bound of dynamic power management). Performance and balanced
#: keep SLEEP_AFTER_S, sparing their requests the wake-up.
BREAK_EVEN_SLEEP_S = WAKE_S / (1.0 - SLEEP_SHARE)


def device_power_w(
    idle_w: Num, max_w: Num, busy: npt.ArrayLike, frequency_scale: npt.ArrayLike
) -> Num:
    """Power of a device busy a share ``busy`` of the time at clock share ``frequency_scale``."""
    dynamic = np.maximum(np.asarray(max_w) - idle_w, 0.0)
    return idle_w + dynamic * np.asarray(busy) * np.asarray(frequency_scale) ** 3  # type: ignore[no-any-return, return-value, unused-ignore]


def marginal_joules(
    service_s: Num,
    idle_w: Num,
    max_w: Num,
    slots: Num,
    busy: npt.ArrayLike,
    idle_s: Num,
    sleep_after_s: float = SLEEP_AFTER_S,
) -> Num:
    """The energy a task adds to each device: its share of the dynamic power while it runs,
    plus, on a device without other work, the idle power of the extra time it stays awake —
    it would have slept ``sleep_after_s`` after its last work, and now sleeps that long after
    this task: ``min(idle_s, sleep_after_s) + service_s`` more seconds."""
    dynamic = np.maximum(np.asarray(max_w) - idle_w, 0.0) / np.asarray(slots)
    extra_awake = np.minimum(np.asarray(idle_s), sleep_after_s) + service_s
    kept_on = np.where(busy, 0.0, extra_awake)
    return np.asarray(service_s) * dynamic + np.asarray(idle_w) * kept_on  # type: ignore[no-any-return, return-value, unused-ignore]


def _at_least(value: Num, low: float) -> Num:
    """max(value, low), elementwise; plain floats stay floats (one device: no numpy call,
    and the same value numpy would give)."""
    if isinstance(value, float):
        return max(value, low)
    return np.maximum(value, low)  # type: ignore[no-any-return, return-value, unused-ignore]


def _minus(a: Num, b: Num) -> Num:
    """a − b, elementwise (``a`` may be a list or a plain float)."""
    if isinstance(a, float) and isinstance(b, float):
        return a - b
    return np.asarray(a) - b  # type: ignore[no-any-return, return-value, unused-ignore]


def estimated_power_w(power_idle_w: Num, power_max_w: Num, intensity: float) -> Num:
    """Power a task adds: base overhead + compute power × intensity (W)."""
    dynamic = _at_least(_minus(power_max_w, power_idle_w), 0.0)
    return dynamic * (TASK_OVERHEAD_SHARE + intensity)  # type: ignore[no-any-return, return-value, unused-ignore]


def available_power_budget_w(power_max_w: Num, power_now_w: Num) -> Num:
    """Device max power − current power (W), never negative."""
    return _at_least(_minus(power_max_w, power_now_w), 0.0)


def max_intensity_for_power(power_idle_w: Num, power_max_w: Num, power_now_w: Num) -> Num:
    """The largest task intensity whose estimated power fits the budget (may be < 0)."""
    dynamic = _at_least(_minus(power_max_w, power_idle_w), 1e-9)
    budget = available_power_budget_w(power_max_w, power_now_w)
    return budget / dynamic - TASK_OVERHEAD_SHARE  # type: ignore[no-any-return, return-value, unused-ignore]


def max_intensity_for_heat(temperature_c: Num, delta_t_c: Num, limit_c: Num) -> Num:
    """The largest intensity whose predicted temperature stays below the limit."""
    headroom = _minus(limit_c, temperature_c)
    return headroom / _at_least(delta_t_c, 1e-9)  # type: ignore[no-any-return, return-value, unused-ignore]


def thermal_backoff(temperature_c: Num, limit_c: Num) -> Num:
    """1 when cool, falling linearly to 0 over the last ``THERMAL_BACKOFF_C`` before the limit."""
    share = _minus(limit_c, temperature_c) / THERMAL_BACKOFF_C
    if isinstance(share, float):  # one device: the same value as numpy's, without its cost
        return min(max(share, 0.0), 1.0)
    return np.minimum(np.maximum(share, 0.0), 1.0)  # type: ignore[no-any-return, return-value, unused-ignore]


def battery_weight(battery_fraction: Num, on_battery: npt.ArrayLike | bool) -> Num:
    """× min(1, battery / 20 %) for a device on battery; 1 when plugged in or without one."""
    weight = np.minimum(1.0, np.asarray(battery_fraction) / BATTERY_THRESHOLD)
    return np.where(on_battery, weight, 1.0)  # type: ignore[no-any-return, return-value, unused-ignore]


@dataclass(frozen=True, slots=True)
class DvfsHint:
    frequency_scale: float
    reason: str


def dvfs_hint(load: float, urgent: bool, temperature_c: float, limit_c: float) -> DvfsHint:
    """Frequency hint: low on light load, high on heavy load or urgent work, low when hot.

    Heat wins over urgency: a device within the back-off band is told to slow down.
    """
    if temperature_c >= limit_c - THERMAL_BACKOFF_C / 2:
        return DvfsHint(0.5, f"overheating: {temperature_c:.0f} °C near limit {limit_c:.0f} °C")
    if urgent:
        return DvfsHint(1.0, "urgent work queued")
    if load >= 0.7:
        return DvfsHint(1.0, f"heavy load {load:.0%}")
    if load <= 0.3:
        return DvfsHint(0.6, f"light load {load:.0%}")
    return DvfsHint(0.8, f"moderate load {load:.0%}")


def cluster_rates(samples: Iterable[TelemetrySample]) -> tuple[float, float]:
    """Cluster throughput (tokens/s) and efficiency (tokens/J) from live devices' samples; the
    efficiency counts only devices that measure their power (tokens and watts alike)."""
    tokens = metered = watts = 0.0
    for sample in samples:
        tokens += sample.measured_tokens_per_s or 0.0
        if sample.power_w is not None:
            metered += sample.measured_tokens_per_s or 0.0
            watts += sample.power_w
    return tokens, (metered / watts if watts > 0 else 0.0)
