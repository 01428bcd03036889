"""Filter, score and multiplier plugins (kube-scheduler style), each a small named object.

* A **filter** returns a boolean mask of devices that can take the task; its ``name`` is the
  reason given for the devices it rejects. It never raises.
* A **score** returns values in [0, 1] per device; the profile weighs it.
* A **multiplier** returns a factor in [0, 1] per device that scales the weighted sum.

``static`` plugins depend only on the fleet and are computed once per cycle; of those, the
``volatile`` ones change when a task is assigned (load, heat) and are recomputed for the one
device a placement changes. The others depend on the task too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from libs.contracts.profiles import Profile
from libs.core import energy
from libs.core.capability import total_score
from libs.core.fleet_state import F64, At, Bool, FleetState, lowest
from libs.core.model import Task

#: How much later than the earliest expected completion ``completion_slack`` lets a task end.
COMPLETION_SLACK = 1.5


class Filter(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def static(self) -> bool: ...
    @property
    def volatile(self) -> bool: ...

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool: ...


class Score(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def static(self) -> bool: ...
    @property
    def volatile(self) -> bool: ...

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64: ...


def best_over(least: float, costs: F64) -> F64:
    """``least`` (the lowest cost among live devices) ÷ each of ``costs``: 1 for the cheapest
    live device, ½ at twice its cost."""
    return np.asarray(max(least, 1e-12) / np.maximum(costs, 1e-12))


def unit(demand: tuple[float, ...]) -> tuple[float, ...]:
    """A demand vector scaled to unit length."""
    norm = math.sqrt(sum(x * x for x in demand))
    return tuple(x / norm for x in demand)


def cosine(capability: F64, demand: tuple[float, ...]) -> F64:
    """Σ capability[k] × demand[k] over the dimensions (the first axis of ``capability``),
    one dimension at a time: each device's value is the same whichever others are with it."""
    total = capability[0] * demand[0]
    for k in range(1, len(demand)):
        total = total + capability[k] * demand[k]
    return np.asarray(total)


def within_slack(finish: F64, earliest: float) -> Bool:
    """Devices that finish within ``COMPLETION_SLACK`` × the earliest completion."""
    return np.asarray(finish <= COMPLETION_SLACK * earliest + 1e-9)


# -- filters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alive:
    """Failed devices take nothing."""

    name: str = "failed"
    static: bool = True
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        return np.asarray(fleet.alive[at])


@dataclass(frozen=True)
class MemoryFits:
    """The task's memory need fits the device's free memory (a watch never gets a 2 GB shard)."""

    name: str = "memory"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        assert task is not None
        return np.asarray(fleet.memory_free_gb[at] >= task.memory_gb)


@dataclass(frozen=True)
class PowerBudget:
    """Estimated power (base + compute × intensity) fits max − current power."""

    name: str = "power"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        assert task is not None
        return np.asarray(fleet.max_intensity_power[at] >= task.intensity)


@dataclass(frozen=True)
class Thermal:
    """Predicted temperature (current + ΔT × intensity) stays below the device's limit."""

    name: str = "thermal"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        assert task is not None
        return np.asarray(fleet.max_intensity_heat[at] > task.intensity)


@dataclass(frozen=True)
class BatteryFloor:
    """A device on battery below 5 % takes no new work."""

    name: str = "battery"
    static: bool = True
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        return np.asarray(~fleet.on_battery[at] | (fleet.battery[at] >= energy.BATTERY_FLOOR))


@dataclass(frozen=True)
class CompletionSlack:
    """Only devices that would finish the task within ``SLACK`` × the earliest expected
    completion (energy mode saves joules inside this bound, never by a long tail)."""

    name: str = "completion_slack"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: At) -> Bool:
        assert task is not None
        return within_slack(fleet.completion_s(task, at), fleet.earliest_s(task))


# -- scores ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMatch:
    """Cosine similarity of the task's demand and the device's capability: the best *fit*.

    Summed one dimension at a time, so that a device's value is the same whether it is scored
    alone, with a few others or with the whole fleet (a matrix product's rounding depends on
    how many rows it is given, and the block search must agree with scoring every device)."""

    name: str = "device_match"
    static: bool = False
    volatile: bool = False

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        assert task is not None
        return cosine(fleet.capability_unit_t[:, at], unit(task.demand))


@dataclass(frozen=True)
class Capability:
    """The device's total score under the profile's dimension weights (w1..w5)."""

    name: str = "capability"
    static: bool = True
    volatile: bool = False

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        return total_score(fleet.capability[at], profile.dimensions.as_tuple())


@dataclass(frozen=True)
class Idle:
    """1 / (1 + load): 1 for an idle device, falling as work queues (the −δ·load term)."""

    name: str = "load"
    static: bool = True
    volatile: bool = True

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        return np.asarray(1.0 / (1.0 + fleet.load[at]))


@dataclass(frozen=True)
class Completion:
    """The load term in time: fastest expected completion ÷ this device's (1 for the device
    that would finish the task first; 0.5 for one that would take twice as long). Completion
    is the wait for a slot plus the task's own prefill and decode there (``FleetState``)."""

    name: str = "completion"
    static: bool = False
    volatile: bool = False

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        assert task is not None
        return best_over(fleet.earliest_s(task), fleet.completion_s(task, at))


@dataclass(frozen=True)
class Energy:
    """Fewest joules ÷ this device's joules for the task (1 for the cheapest): its share of
    dynamic power while it runs, plus idle power it keeps on — so work gathers on devices that
    are awake and efficient, and the others can sleep (``energy.marginal_joules``)."""

    name: str = "energy"
    static: bool = False
    volatile: bool = False

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        assert task is not None
        joules = fleet.marginal_j(task, profile.sleep_after_s)
        return best_over(lowest(joules, fleet.alive), joules[at])


# -- multipliers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Battery:
    """× min(1, battery / 20 %) for devices on battery."""

    name: str = "battery"
    static: bool = True
    volatile: bool = False

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        return np.asarray(energy.battery_weight(fleet.battery[at], fleet.on_battery[at]))


@dataclass(frozen=True)
class ThermalBackoff:
    """Falls linearly to 0 over the last 10 °C before the thermal limit."""

    name: str = "thermal_backoff"
    static: bool = True
    volatile: bool = True

    def values(self, fleet: FleetState, task: Task | None, profile: Profile, at: At) -> F64:
        return np.asarray(
            energy.thermal_backoff(fleet.temperature_c[at], fleet.thermal_limit_c[at])
        )


FILTERS: dict[str, Filter] = {
    "alive": Alive(),
    "memory": MemoryFits(),
    "power": PowerBudget(),
    "thermal": Thermal(),
    "battery_floor": BatteryFloor(),
    "completion_slack": CompletionSlack(),
}
SCORES: dict[str, Score] = {
    "device_match": DeviceMatch(),
    "capability": Capability(),
    "load": Idle(),
    "completion": Completion(),
    "energy": Energy(),
}
MULTIPLIERS: dict[str, Score] = {"battery": Battery(), "thermal_backoff": ThermalBackoff()}


def resolve(profile: Profile) -> tuple[list[Filter], list[tuple[Score, float]], list[Score]]:
    """The plugin objects a profile names. Raises ``KeyError`` naming an unknown plugin."""
    try:
        filters = [FILTERS[name] for name in profile.filters]
        scores = [(SCORES[name], weight) for name, weight in profile.scores.items()]
        multipliers = [MULTIPLIERS[name] for name in profile.multipliers]
    except KeyError as exc:
        raise KeyError(f"profile {profile.name!r} names unknown plugin {exc.args[0]!r}") from None
    return filters, scores, multipliers
