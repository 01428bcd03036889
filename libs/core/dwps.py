"""Dynamic weighted priority scheduling (DWPS).

P(task, device) = α·urgency + β·complexity + γ·device_match − δ·load, with the capability
total and the battery and heat multipliers (``libs/core/energy.py``) folded into the device
part (see ``plugins``).
Tasks of one cycle are taken in order of α·urgency + β·complexity (then earliest deadline) and
each goes to its highest-P feasible device; every placement updates that device's load,
memory, power and heat before the next task is decided, so urgent tasks do not pile onto the
same best device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libs.contracts import Mode
from libs.contracts.profiles import Profile
from libs.core.fleet_state import FleetState
from libs.core.model import Placement, Task
from libs.core.pipeline import Pipeline
from libs.core.policy import Observer, in_input_order, place_each
from libs.core.profiles import BUILTIN_PROFILES


class Dwps:
    name = "dwps"

    def __init__(self, profile: Profile | None = None, observer: Observer | None = None) -> None:
        self.profile = profile or BUILTIN_PROFILES[Mode.BALANCED]
        self.pipeline = Pipeline(self.profile)
        self.observer = observer

    def task_priority(self, task: Task) -> float:
        return self.profile.urgency * task.urgency + self.profile.complexity * task.complexity

    def order(self, tasks: Sequence[Task]) -> list[Task]:
        return sorted(
            tasks,
            key=lambda t: (
                -self.task_priority(t),
                t.deadline if t.deadline is not None else float("inf"),
                t.release,
                t.task_id,
            ),
        )

    def place(
        self, fleet: FleetState, tasks: Sequence[Task], now: float, rng: np.random.Generator
    ) -> list[Placement]:
        def pick(task: Task) -> tuple[int | None, float]:
            index, score = self.pipeline.pick(task)
            return index, self.task_priority(task) + score

        decided = place_each(self.pipeline, fleet, self.order(tasks), pick, self.observer)
        return in_input_order(tasks, decided)
