"""Routing: each inference request for a deployed model goes to one copy that serves.

A copy (a deployment or one of its replicas) takes requests only once its workers reported
every shard of its current plan loaded (``phases.py``); among those the active policy picks
(``replicas.py``). None serving: the request is not placed, and the answer says why (still
loading and how far, refused or failed with the workers' reason, or waiting on a failed
device). Called from the scheduler's command loop only.
"""

from __future__ import annotations

import numpy as np

from libs.contracts import DeploymentState, InferenceRequest, PlacementDecision, PlacementRequest
from libs.contracts.base import Mode
from libs.core.policy import Policy
from libs.deployments import DeploymentBook, phases, resolve
from services.scheduler.planning import Planner
from services.scheduler.replicas import ENGINE_SLOTS, Running, choose_replica, replica_device
from services.scheduler.view import ClusterView


class Router:
    def __init__(self, planner: Planner, view: ClusterView, rng: np.random.Generator) -> None:
        self.planner, self.view, self.rng = planner, view, rng
        #: Requests routed to replicas, until they are expected to end.
        self.running: list[Running] = []

    @staticmethod
    def named(book: DeploymentBook, task: InferenceRequest) -> DeploymentState | None:
        """The deployment a request is for: the one its sender resolved, else what its model
        name means (``libs.deployments.resolve``: the one rule for names)."""
        if task.deployment_id is not None:
            return book.get(task.deployment_id)
        return resolve(task.model, book)

    def route(
        self,
        book: DeploymentBook,
        request: PlacementRequest,
        deployment: DeploymentState,
        now: float,
        policy: Policy,
        policy_name: str,
        mode: Mode,
    ) -> PlacementDecision:
        """An inference request for a deployed model goes to the serving copy ``policy``
        chooses on live state (``replicas.py``); none serving: not placed, saying why."""
        task = request.task
        assert isinstance(task, InferenceRequest)
        base = deployment.base
        group = [d for d in book.group(base) if d.phase == "serving"]
        self.running = [r for r in self.running if r.until > now]
        held = {a.device_id for d in group for a in d.assignments}
        # Only the copies' devices: their speed and state (load and memory do not count here).
        devices = {d.device_id: d for d in self.view.devices({}, {}, only=held)}
        candidates = []
        for replica in group:
            spec = self.planner.spec_of(replica.model, replica.precision)
            slots = self.slots_of(replica)
            device = replica_device(replica, devices, slots, self.running, now, spec)
            if device is not None:
                candidates.append(device)
        chosen = choose_replica(policy, candidates, request, now, self.rng)
        if chosen is None:
            return PlacementDecision(
                task_id=task.request_id,
                kind="inference",
                placed=False,
                reason=self.why_not_serving(book, base),
                policy="route",
                mode=mode,
                epoch=deployment.epoch,
                ts=now,
            )
        replica_id, seconds = chosen
        self.running.append(Running(replica_id, now + seconds))
        replica = book.by_id[replica_id]
        return PlacementDecision(
            task_id=task.request_id,
            kind="inference",
            placed=True,
            assignments=replica.assignments,
            policy=policy_name,
            mode=mode,
            epoch=replica.epoch,
            ts=now,
            deployment_id=replica_id,
        )

    def why_not_serving(self, book: DeploymentBook, base: str) -> str:
        group = book.group(base)
        held = {a.device_id for d in group for a in d.assignments}
        failed = sorted(held & self.view.failed)
        if failed:
            return f"no_capacity: {base} waits on failed {failed}"
        copies = ", ".join(
            f"{d.deployment_id} {d.phase} ({phases.progress(d):.0%})"
            + (f": {d.reason}" if d.phase in phases.FINAL and d.reason else "")
            for d in sorted(group, key=lambda d: d.deployment_id)
        )
        return f"not_serving: {copies}"

    def slots_of(self, deployment: DeploymentState) -> int:
        """Requests a copy runs at once: what its head's worker announces, else its engine's
        default (the most of its devices' engines)."""
        head = min(deployment.assignments, key=lambda a: a.shard_index).device_id
        announce = self.view.announces.get(head)
        if announce is not None and announce.slots:
            return announce.slots
        engines = [
            e
            for a in deployment.assignments
            if (found := self.view.announces.get(a.device_id)) is not None
            for e in found.engines
        ]
        return max((ENGINE_SLOTS.get(e, 1) for e in engines), default=1)
