"""The scheduler's decisions: built, answered to whoever asked, published and counted."""

from __future__ import annotations

import asyncio

from libs.contracts import PLACEMENT_DECISION, DeploymentState, Mode, PlacementDecision
from libs.runtime.bus import Bus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import TaskState
from services.scheduler.view import ClusterView


def refusal(deployment_id: str, reason: str, mode: Mode, now: float) -> PlacementDecision:
    """A deploy that placed nothing, and why."""
    return PlacementDecision(
        task_id=deployment_id,
        kind="deployment",
        placed=False,
        reason=reason,
        policy="partition",
        mode=mode,
        ts=now,
        deployment_id=deployment_id,
    )


def plan_decision(deployment: DeploymentState, mode: Mode, now: float) -> PlacementDecision:
    """A deployment's current plan as a decision."""
    return PlacementDecision(
        task_id=deployment.deployment_id,
        kind="deployment",
        placed=True,
        assignments=deployment.assignments,
        policy="partition",
        mode=mode,
        epoch=deployment.epoch,
        ts=now,
        deployment_id=deployment.deployment_id,
    )


class Announcer:
    def __init__(
        self,
        bus: Bus,
        metrics: SchedulerMetrics,
        view: ClusterView,
        tasks: TaskState,
    ) -> None:
        """``tasks``: the scheduler's task state, where decisions are kept and counted."""
        self.bus, self.metrics, self.view, self.tasks = bus, metrics, view, tasks

    async def announce(
        self,
        decision: PlacementDecision,
        reply: str | None = None,
        future: asyncio.Future[PlacementDecision] | None = None,
    ) -> None:
        """Publish a decision, answer its caller, and account for it."""
        tasks = self.tasks
        tasks.decisions.appendleft(decision)
        if decision.placed:
            tasks.counters["placed"] += 1
            for a in decision.assignments:
                cls = self.view.announces.get(a.device_id)
                self.metrics.assignments.labels(
                    decision.policy, cls.device_class.value if cls else "unknown"
                ).inc()
        else:
            tasks.counters["rejected"] += 1
            self.metrics.rejections.labels((decision.reason or "unknown").split(":")[0]).inc()
        if reply:  # the caller first (the gateway waits on it), then the broadcast
            await self.bus.reply(reply, PLACEMENT_DECISION, decision)
        if future is not None and not future.done():
            future.set_result(decision)
        await self.bus.publish(PLACEMENT_DECISION, decision, task_id=decision.task_id)
