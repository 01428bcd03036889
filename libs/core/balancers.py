"""Load-balancing policies: where to send each task among the feasible devices.

Every balancer shares the hard filters (memory, power, heat, failed, battery floor) so that no
policy sends a task to a device that cannot hold it; they differ only in the pick.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from libs.contracts import Mode
from libs.core.fleet_state import FleetState
from libs.core.hashing import HashRing, stable_hash
from libs.core.model import Placement, Task
from libs.core.pipeline import Pipeline
from libs.core.policy import Chooser, place_in_order
from libs.core.profiles import BUILTIN_PROFILES


class Balancer(ABC):
    """Base: arrival order, the shared filters, and a ``choose`` of the subclass."""

    name = "balancer"

    def __init__(self) -> None:
        self.pipeline = Pipeline(BUILTIN_PROFILES[Mode.BALANCED])
        self.rng: np.random.Generator = np.random.default_rng(0)

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        self.rng = rng
        return place_in_order(self.pipeline, fleet, tasks, self.chooser(fleet))

    @abstractmethod
    def chooser(self, fleet: FleetState) -> Chooser:
        """The per-task pick for this fleet."""


class RandomBalancer(Balancer):
    name = "random"

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            return int(self.rng.choice(np.flatnonzero(feasible))), 0.0

        return choose


class RoundRobin(Balancer):
    """Next feasible device after the last one used, in device order."""

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self.cursor = -1

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            n = len(feasible)
            order = (np.arange(n) + self.cursor + 1) % n
            self.cursor = int(order[np.argmax(feasible[order])])
            return self.cursor, 0.0

        return choose


class WeightedRoundRobin(Balancer):
    """Smooth weighted round robin (as nginx): each device's share follows its speed."""

    name = "weighted_round_robin"

    def __init__(self) -> None:
        super().__init__()
        self.current: dict[str, float] = {}

    def chooser(self, fleet: FleetState) -> Chooser:
        weights = fleet.speed

        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            current = np.array([self.current.get(d, 0.0) for d in fleet.ids]) + weights
            pick = int(np.argmax(np.where(feasible, current, -np.inf)))
            current[pick] -= weights[feasible].sum()
            self.current = dict(zip(fleet.ids, current.tolist(), strict=True))
            return pick, 0.0

        return choose


class LeastConnections(Balancer):
    """The feasible device with the lowest load (ties: the faster one)."""

    name = "least_connections"

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            key = np.where(feasible, fleet.load - 1e-9 * fleet.speed, np.inf)
            return int(np.argmin(key)), 0.0

        return choose


class PowerOfTwo(Balancer):
    """Two random feasible devices; the less loaded wins."""

    name = "power_of_two"

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            candidates = np.flatnonzero(feasible)
            pair = self.rng.choice(candidates, size=min(2, len(candidates)), replace=False)
            return int(min(pair, key=lambda i: fleet.load[i])), 0.0

        return choose


class SourceHash(Balancer):
    """hash(source) mod n over all devices, probing forward past infeasible ones."""

    name = "source_hash"

    def chooser(self, fleet: FleetState) -> Chooser:
        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            n = len(feasible)
            start = stable_hash(task.source or task.task_id) % n
            order = (np.arange(n) + start) % n
            return int(order[np.argmax(feasible[order])]), 0.0

        return choose


class ConsistentHash(Balancer):
    """A ring with virtual nodes: a source sticks to its device; churn moves ~1/n of sources."""

    name = "consistent_hash"

    def __init__(self, replicas: int = 160) -> None:
        super().__init__()
        self.replicas = replicas
        self._ring: tuple[tuple[str, ...], HashRing] | None = None

    def ring(self, ids: Sequence[str]) -> HashRing:
        key = tuple(ids)
        if self._ring is None or self._ring[0] != key:
            self._ring = (key, HashRing(ids, self.replicas))
        return self._ring[1]

    def chooser(self, fleet: FleetState) -> Chooser:
        ring = self.ring(fleet.ids)

        def choose(task: Task, feasible: np.ndarray) -> tuple[int | None, float]:
            for device_id in ring.walk(task.source or task.task_id):
                if feasible[fleet.index[device_id]]:
                    return fleet.index[device_id], 0.0
            return None, 0.0

        return choose
