"""The scheduler's state and its checkpoint form. Pure: no I/O."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field

from libs.contracts import (
    DeploymentState,
    Mode,
    PlacementDecision,
    PlacementRequest,
    SchedulerCheckpoint,
)
from libs.contracts.profiles import Profile
from libs.core.profiles import BUILTIN_PROFILES

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
class SchedulerState:
    mode: Mode = Mode.BALANCED
    manual_mode: bool = False
    policy: str = "dwps"
    profile: Profile = field(default_factory=lambda: BUILTIN_PROFILES[Mode.BALANCED])
    deployments: dict[str, DeploymentState] = field(default_factory=dict)
    decisions: deque[PlacementDecision] = field(default_factory=lambda: deque(maxlen=1000))
    queue: list[PlacementRequest] = field(default_factory=list)
    active: dict[str, ActiveTask] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)

    def load_by_device(self, now: float) -> Counter[str]:
        """Tasks each device is running, from this scheduler's own placements."""
        for task_id in [t for t, a in self.active.items() if a.until <= now]:
            del self.active[task_id]
        return Counter(a.device_id for a in self.active.values())

    def reserved_memory_gb(self, without: str | None = None) -> Counter[str]:
        """GB that deployments (all, or all but ``without``) hold on each device; one that
        ended refused or failed holds none (its shards were unloaded)."""
        reserved: Counter[str] = Counter()
        for deployment in self.deployments.values():
            if deployment.deployment_id == without or deployment.phase in ("refused", "failed"):
                continue
            for assignment in deployment.assignments:
                reserved[assignment.device_id] += assignment.memory_gb  # type: ignore[assignment]
        return reserved

    def checkpoint(self, now: float) -> SchedulerCheckpoint:
        weights = {f"score.{k}": v for k, v in self.profile.scores.items()}
        weights |= {f"dimension.{k}": v for k, v in self.profile.dimensions.model_dump().items()}
        weights |= {"urgency": self.profile.urgency, "complexity": self.profile.complexity}
        return SchedulerCheckpoint(
            ts=now,
            mode=self.mode,
            policy=self.policy,
            weights=weights,
            deployments=tuple(self.deployments.values()),
            placements=tuple(self.decisions),
            queue=tuple(self.queue),
            counters=dict(self.counters),
        )

    @classmethod
    def restore(cls, checkpoint: SchedulerCheckpoint, decisions_kept: int) -> SchedulerState:
        """The state a checkpoint describes. Weights are the built-in profile of its mode:
        a custom profile set at run time is configuration and is set again by its owner."""
        state = cls(
            mode=checkpoint.mode,
            policy=checkpoint.policy,
            profile=BUILTIN_PROFILES[checkpoint.mode],
            deployments={d.deployment_id: d for d in checkpoint.deployments},
            decisions=deque(checkpoint.placements, maxlen=decisions_kept),
            queue=list(checkpoint.queue),
            counters=Counter(checkpoint.counters),
        )
        return state
