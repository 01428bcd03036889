"""The scheduler's own bookkeeping of inference requests and jobs (deployments are the
deployment book's, libs/deployments). Pure: no I/O."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field

from libs.contracts import PlacementDecision, PlacementRequest

#: A request waiting for the next cycle, with its reply subject and its caller's future.
Pending = tuple[PlacementRequest, str | None, "asyncio.Future[PlacementDecision] | None"]


@dataclass
class ActiveTask:
    """A placed inference request or job, counted in its device's load until ``until``."""

    task_id: str
    device_id: str
    until: float
    request: PlacementRequest


@dataclass
class TaskState:
    decisions: deque[PlacementDecision] = field(default_factory=lambda: deque(maxlen=1000))
    active: dict[str, ActiveTask] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)

    @classmethod
    def keeping(cls, decisions: int) -> TaskState:
        """A state that keeps the last ``decisions`` decisions."""
        return cls(decisions=deque(maxlen=decisions))

    def load_by_device(self, now: float) -> Counter[str]:
        """Tasks each device is running, from this scheduler's own placements."""
        for task_id in [t for t, a in self.active.items() if a.until <= now]:
            del self.active[task_id]
        return Counter(a.device_id for a in self.active.values())

    def urgent_devices(self) -> set[str]:
        """Devices running urgent work (urgency 0.8 or more): their clocks stay up."""
        return {
            a.device_id
            for a in self.active.values()
            if getattr(a.request.task, "urgency", 0.0) >= 0.8
        }
