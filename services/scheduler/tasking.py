"""Placing a cycle's inference requests (for models not deployed) and jobs with the active
policy, and taking a failed device's tasks back. Called from the scheduler's command loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from libs.contracts import Mode, PlacementDecision
from libs.core.fleet_state import FleetState
from libs.core.policy import Policy
from libs.deployments import DeploymentBook
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.planning import Planner
from services.scheduler.state import ActiveTask, Pending, TaskState
from services.scheduler.tasks import decision_for, expected_seconds, to_task

Answer = tuple[str | None, "asyncio.Future[PlacementDecision] | None"]


@dataclass
class Placed:
    """A cycle's decisions, each with whom to answer, and the fleet as they left it."""

    decisions: list[tuple[Answer, PlacementDecision]]
    fleet: FleetState


class TaskPlacer:
    def __init__(
        self,
        planner: Planner,
        metrics: SchedulerMetrics,
        rng: np.random.Generator,
    ) -> None:
        self.planner, self.metrics, self.rng = planner, metrics, rng

    def place(
        self,
        book: DeploymentBook,
        batch: list[Pending],
        now: float,
        policy: Policy,
        policy_name: str,
        mode: Mode,
        tasks: TaskState,
    ) -> Placed:
        """Place ``batch`` together; each placed task counts in its device's load (``tasks``)
        until it is expected to end."""
        devices = self.planner.devices(book, now)
        fleet = FleetState(devices)
        by_id = {d.device_id: d for d in devices}
        core_tasks = [
            to_task(r, self.planner.spec_of(getattr(r.task, "model", ""))) for r, _, _ in batch
        ]
        started = time.perf_counter()
        placements = policy.place(fleet, core_tasks, now, self.rng)
        per_task = (time.perf_counter() - started) / max(1, len(core_tasks))
        decisions: list[tuple[Answer, PlacementDecision]] = []
        for (request, reply, future), placement in zip(batch, placements, strict=True):
            self.metrics.decision_seconds.observe(per_task)
            decision = decision_for(request, placement, policy_name, mode, now)
            if placement.device_id is not None:
                self.metrics.match_score.observe(placement.score)
                device = by_id[placement.device_id]
                until = now + expected_seconds(request, device.speed)
                tasks.active[request.task_id] = ActiveTask(
                    request.task_id, placement.device_id, until, request
                )
            decisions.append(((reply, future), decision))
        return Placed(decisions, fleet)

    @staticmethod
    def take_back(tasks: TaskState, device_id: str) -> list[ActiveTask]:
        """The tasks placed on ``device_id``, no longer counted there."""
        moved = [a for a in tasks.active.values() if a.device_id == device_id]
        for active in moved:
            del tasks.active[active.task_id]
        return moved
