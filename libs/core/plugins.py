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

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from libs.contracts.profiles import Profile
from libs.core import energy
from libs.core.capability import total_score
from libs.core.fleet import F64, Bool, FleetState
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

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool: ...


class Score(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def static(self) -> bool: ...
    @property
    def volatile(self) -> bool: ...

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64: ...


def lowest(costs: F64, alive: Bool) -> float:
    """The least of ``costs`` among live devices (all, when none is alive; 0 for no device)."""
    usable = costs[alive] if alive.any() else costs
    return float(usable.min()) if len(usable) else 0.0


def best_over(costs: F64, alive: Bool, at: slice | int) -> F64:
    """Lowest cost ÷ each device's cost: 1 for the cheapest live device, ½ at twice its cost."""
    best = max(lowest(costs, alive), 1e-12)
    return np.asarray(best / np.maximum(costs[at], 1e-12))


# -- filters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alive:
    """Failed devices take nothing."""

    name: str = "failed"
    static: bool = True
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        return np.asarray(fleet.alive[at])


@dataclass(frozen=True)
class MemoryFits:
    """The task's memory need fits the device's free memory (a watch never gets a 2 GB shard)."""

    name: str = "memory"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        assert task is not None
        return np.asarray(fleet.memory_free_gb[at] >= task.memory_gb)


@dataclass(frozen=True)
class PowerBudget:
    """Estimated power (base + compute × intensity) fits max − current power."""

    name: str = "power"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        assert task is not None
        return np.asarray(fleet.max_intensity_power[at] >= task.intensity)


@dataclass(frozen=True)
class Thermal:
    """Predicted temperature (current + ΔT × intensity) stays below the device's limit."""

    name: str = "thermal"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        assert task is not None
        return np.asarray(fleet.max_intensity_heat[at] > task.intensity)


@dataclass(frozen=True)
class BatteryFloor:
    """A device on battery below 5 % takes no new work."""

    name: str = "battery"
    static: bool = True
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        return np.asarray(~fleet.on_battery[at] | (fleet.battery[at] >= energy.BATTERY_FLOOR))


@dataclass(frozen=True)
class CompletionSlack:
    """Only devices that would finish the task within ``SLACK`` × the earliest expected
    completion (energy mode saves joules inside this bound, never by a long tail)."""

    name: str = "completion_slack"
    static: bool = False
    volatile: bool = False

    def mask(self, fleet: FleetState, task: Task | None, at: slice | int) -> Bool:
        assert task is not None
        finish = fleet.completion_s(task)
        return np.asarray(finish[at] <= COMPLETION_SLACK * lowest(finish, fleet.alive) + 1e-9)


# -- scores ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMatch:
    """Cosine similarity of the task's demand and the device's capability: the best *fit*."""

    name: str = "device_match"
    static: bool = False
    volatile: bool = False

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        assert task is not None
        demand = np.asarray(task.demand, dtype=np.float64)
        demand /= np.linalg.norm(demand)
        if at == slice(None):  # the hot path: whole fleet, float32, contiguous rows
            return demand.astype(np.float32) @ fleet.capability_unit_t32  # type: ignore[return-value]
        return np.asarray(fleet.capability_unit[at] @ demand)


@dataclass(frozen=True)
class Capability:
    """The device's total score under the profile's dimension weights (w1..w5)."""

    name: str = "capability"
    static: bool = True
    volatile: bool = False

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        return total_score(fleet.capability[at], profile.dimensions.as_tuple())


@dataclass(frozen=True)
class Idle:
    """1 / (1 + load): 1 for an idle device, falling as work queues (the −δ·load term)."""

    name: str = "load"
    static: bool = True
    volatile: bool = True

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        return np.asarray(1.0 / (1.0 + fleet.load[at]))


@dataclass(frozen=True)
class Completion:
    """The load term in time: fastest expected completion ÷ this device's (1 for the device
    that would finish the task first; 0.5 for one that would take twice as long). Completion
    is the wait for a slot plus the task's own prefill and decode there (``FleetState``)."""

    name: str = "completion"
    static: bool = False
    volatile: bool = False

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        assert task is not None
        return best_over(fleet.completion_s(task), fleet.alive, at)


@dataclass(frozen=True)
class Energy:
    """Fewest joules ÷ this device's joules for the task (1 for the cheapest): its share of
    dynamic power while it runs, plus idle power it keeps on — so work gathers on devices that
    are awake and efficient, and the others can sleep (``energy.marginal_joules``)."""

    name: str = "energy"
    static: bool = False
    volatile: bool = False

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        assert task is not None
        return best_over(fleet.marginal_j(task, profile.sleep_after_s), fleet.alive, at)


# -- multipliers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Battery:
    """× min(1, battery / 20 %) for devices on battery."""

    name: str = "battery"
    static: bool = True
    volatile: bool = False

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
        return np.asarray(energy.battery_weight(fleet.battery[at], fleet.on_battery[at]))


@dataclass(frozen=True)
class ThermalBackoff:
    """Falls linearly to 0 over the last 10 °C before the thermal limit."""

    name: str = "thermal_backoff"
    static: bool = True
    volatile: bool = True

    def values(
        self, fleet: FleetState, task: Task | None, profile: Profile, at: slice | int
    ) -> F64:
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
