"""The scheduler's deployment book and what goes out when it changes.

``DeploymentLog`` holds the book (``libs/deployments``) as a value and replaces it with each
change the deployer's commands return (``commit``): the change is recorded as the next indexed
event, the shard tasks it implies are sent (an old plan's unloads before a new plan's loads),
and the event is published on ``DEPLOYMENT_EVENT`` for every follower. The whole book goes out
on ``DEPLOYMENTS_SNAPSHOT`` when this scheduler starts leading and every 15 s, so a follower
that missed an event catches up. Called from the scheduler's command loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.contracts import (
    DEPLOYMENT_EVENT,
    DEPLOYMENTS_SNAPSHOT,
    SHARD_TASK,
    DeploymentChange,
    DeploymentMeasured,
    DeploymentPlanned,
    DeploymentState,
    ShardReported,
    ShardStatus,
)
from libs.deployments import DeploymentBook, phases, record
from libs.runtime.bus import Bus
from services.scheduler.deployments import Deployer
from services.scheduler.metrics import SchedulerMetrics

log = logging.getLogger("services.scheduler.deployments")


@dataclass
class Committed:
    """What a commit did that the scheduler acts on: the plans it sent that replace a live
    plan or add a replica (announced as decisions), and whether the book must be saved."""

    plans: list[DeploymentState] = field(default_factory=list)
    #: Live plans replaced by a new one (migrations).
    replans: int = 0
    save: bool = False


class DeploymentLog:
    def __init__(self, bus: Bus, deployer: Deployer, metrics: SchedulerMetrics, term: str) -> None:
        self.bus, self.deployer, self.metrics = bus, deployer, metrics
        self.book = DeploymentBook(term=term)
        #: Restored plans whose tasks wait to go out again: their epoch, and until when.
        self.waiting: dict[str, tuple[int, float]] = {}

    def restore(self, book: DeploymentBook) -> None:
        """Start from a checkpoint's book (numbered on under this leader's term)."""
        self.book = book.restored(self.book.term)

    async def commit(self, changes: list[DeploymentChange], now: float) -> Committed:
        """Record each change, send its shard tasks, publish it; in order, one at a time."""
        committed = Committed()
        for change in changes:
            before = self.book
            self.book, [event] = record(before, [change], now)
            committed.save |= self._note(before, change, committed)
            if isinstance(change, DeploymentPlanned):
                self.deployer.heard_plan(change.deployment, now)
                committed.plans.append(change.deployment)
            for batch in self.deployer.tasks_for(before, change, now):
                # One JetStream round trip per batch: each device's task is on a subject of
                # its own (a device's unload is stored before its load of the next plan).
                await asyncio.gather(
                    *(self.bus.publish_durable(SHARD_TASK, t, device_id=t.device_id) for t in batch)
                )
            await self.bus.publish(DEPLOYMENT_EVENT, event, deployment_id=_about(change))
        return committed

    def _note(self, before: DeploymentBook, change: DeploymentChange, committed: Committed) -> bool:
        """Log and count ``change``; whether it is worth a checkpoint (a shard's progress
        alone is not)."""
        deployment_id = _about(change)
        old, new = before.get(deployment_id), self.book.get(deployment_id)
        if isinstance(change, DeploymentMeasured):
            return False  # news of a speed, not of a plan (``speeds.measured`` logs it)
        if isinstance(change, ShardReported):
            if old is None or new is None or old.phase == new.phase:
                return False
            log.info("deployment phase", extra={"deployment_id": deployment_id, "phase": new.phase})
            return True
        if isinstance(change, DeploymentPlanned):
            devices = list(change.deployment.route)
            if old is not None and old.phase not in phases.FINAL:
                committed.replans += 1
                self.metrics.migrations.inc()
                log.warning(
                    "deployment re-planned",
                    extra={
                        "deployment_id": deployment_id,
                        "reason": change.deployment.reason,
                        "devices": devices,
                        "epoch": change.deployment.epoch,
                    },
                )
            else:
                log.info(
                    "deployment planned",
                    extra={
                        "deployment_id": deployment_id,
                        "model": change.deployment.model,
                        "devices": devices,
                        "phase": change.deployment.phase,
                    },
                )
        elif new is not None and new.phase in phases.FINAL:
            log.error(
                "deployment stopped",
                extra={"deployment_id": deployment_id, "phase": new.phase, "reason": new.reason},
            )
        return True

    async def publish_snapshot(self, now: float) -> None:
        await self.bus.publish(DEPLOYMENTS_SNAPSHOT, self.book.snapshot(now))

    def await_devices(self, epochs: dict[str, int], until: float) -> None:
        """After a restart: each live plan of ``epochs`` (its deployment's epoch at the
        restore) waits, until ``until``, for its devices to announce again (``resend``)."""
        self.waiting = {d: (epoch, until) for d, epoch in epochs.items()}

    async def resend(self, now: float, announced: Callable[[str], bool]) -> None:
        """The load tasks of each waiting plan go out again once every device of its route
        ``announced`` since the restart (so the tasks carry the addresses their workers have
        now: after a whole cluster's restart they are not the checkpoint's), or when its wait
        ends. Workers report again (reports sent while no scheduler led were lost; a worker
        that serves the shard answers ``loaded`` again, one that dropped it loads it). A plan
        re-planned meanwhile waits no more: its new tasks went out."""
        for deployment in self.book.live():
            held = self.waiting.get(deployment.deployment_id)
            if held is None:
                continue
            epoch, until = held
            ready = all(announced(d) for d in deployment.route) or now >= until
            if deployment.epoch == epoch and not ready:
                continue
            del self.waiting[deployment.deployment_id]
            if deployment.epoch != epoch:
                continue
            await self._send_again(deployment, now)
        live = {d.deployment_id for d in self.book.live()}
        self.waiting = {d: held for d, held in self.waiting.items() if d in live}

    async def resend_to(self, devices: set[str], now: float) -> None:
        """``devices`` announced themselves again: a worker started again (by ``tessera up``'s
        supervision, sooner than the failure detector notices) holds no shard, and its RPC
        server listens at a new address. Each live plan on one of them, not waiting already
        (``resend``), sends its load tasks again: that worker loads its shard, the split's
        head gets the new address; a worker that still serves answers ``loaded`` again."""
        for deployment in self.book.live():
            if deployment.deployment_id in self.waiting or not devices & set(deployment.route):
                continue
            log.info(
                "tasks sent again",
                extra={"deployment_id": deployment.deployment_id, "announced": sorted(devices)},
            )
            await self._send_again(deployment, now)

    async def _send_again(self, deployment: DeploymentState, now: float) -> None:
        """A live plan's load tasks, out again; its silence counts from now."""
        self.deployer.heard_plan(deployment, now)
        tasks = self.deployer.shard_tasks(deployment, "load", now)
        await asyncio.gather(
            *(self.bus.publish_durable(SHARD_TASK, t, device_id=t.device_id) for t in tasks)
        )

    async def unload_stale(self, status: ShardStatus, now: float) -> None:
        """Tell a worker still holding a re-planned epoch to drop it (once)."""
        task = self.deployer.stale_unload(self.book, status, now)
        if task is not None:
            log.info(
                "stale shard unloaded", extra={"device_id": status.device_id, "epoch": status.epoch}
            )
            await self.bus.publish_durable(SHARD_TASK, task, device_id=status.device_id)


def _about(change: DeploymentChange) -> str:
    """The deployment a change is about."""
    if isinstance(change, DeploymentPlanned):
        return change.deployment.deployment_id
    return change.deployment_id
