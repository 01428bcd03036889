"""Queue-discipline policies: FCFS, SJF, priority, round robin with time slice, MLFQ.

In a decision cycle they order the batch by their discipline and send each task to the
least-loaded feasible device; ``queue_factory`` builds the per-device queue a simulator (or
a worker) runs them from, which is where time slices and feedback levels act.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from libs.core.balancers import LeastConnections
from libs.core.fleet_state import FleetState
from libs.core.model import Placement, Task
from libs.core.policy import in_input_order, place_in_order
from libs.core.queueing import QUEUES, TaskQueue


class QueuedPolicy(LeastConnections):
    def __init__(self, name: str, queue_factory: Callable[[], TaskQueue]) -> None:
        super().__init__()
        self.name = name
        self.queue_factory = queue_factory

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        queue = self.queue_factory()
        for task in tasks:
            queue.push(task, now)
        ordered = []
        while (item := queue.pop(now)) is not None:
            ordered.append(item[0])
        decided = place_in_order(self.pipeline, fleet, ordered, self.chooser(fleet))
        return in_input_order(tasks, decided)


def queued_policy(name: str, discipline: str | None = None) -> QueuedPolicy:
    return QueuedPolicy(name, QUEUES[discipline or name])
