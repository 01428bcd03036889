"""Queue disciplines: which waiting task a device runs next.

Each queue is a small pure data structure driven by its owner (a device in the simulator, a
scheduler's backlog): ``push`` a task, ``pop`` the next one with the time slice it may run
(``None``: to completion), and ``requeue`` a preempted task with its remaining work.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from libs.core.model import Task


class TaskQueue(Protocol):
    def push(self, task: Task, now: float) -> None: ...
    def pop(self, now: float) -> tuple[Task, float | None] | None: ...
    def requeue(self, task: Task, used_s: float, now: float) -> None: ...
    def tasks(self) -> list[Task]:
        """The waiting tasks in the order they would run (a time estimate reads them)."""
        ...

    def __len__(self) -> int: ...


@dataclass
class KeyedQueue:
    """Non-preemptive: the task with the smallest ``key`` first (ties: arrival order)."""

    key: Callable[[Task], tuple[float, ...]]
    _heap: list[tuple[tuple[float, ...], int, Task]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def push(self, task: Task, now: float) -> None:
        heapq.heappush(self._heap, (self.key(task), next(self._seq), task))

    def pop(self, now: float) -> tuple[Task, float | None] | None:
        return (heapq.heappop(self._heap)[2], None) if self._heap else None

    def requeue(self, task: Task, used_s: float, now: float) -> None:
        self.push(task, now)

    def tasks(self) -> list[Task]:
        return [task for _, _, task in sorted(self._heap, key=lambda e: (e[0], e[1]))]

    def __len__(self) -> int:
        return len(self._heap)


def fcfs_queue() -> KeyedQueue:
    return KeyedQueue(lambda t: (t.release,))


def sjf_queue() -> KeyedQueue:
    return KeyedQueue(lambda t: (t.work, t.release))


def priority_queue() -> KeyedQueue:
    return KeyedQueue(lambda t: (-t.priority, -t.urgency, t.release))


@dataclass
class RoundRobinQueue:
    """FIFO with a fixed time slice; a task that uses its slice goes to the back."""

    time_slice_s: float = 0.1
    _queue: deque[Task] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.time_slice_s <= 0:
            raise ValueError("time_slice_s must be positive")

    def push(self, task: Task, now: float) -> None:
        self._queue.append(task)

    def pop(self, now: float) -> tuple[Task, float | None] | None:
        return (self._queue.popleft(), self.time_slice_s) if self._queue else None

    def requeue(self, task: Task, used_s: float, now: float) -> None:
        self._queue.append(task)

    def tasks(self) -> list[Task]:
        return list(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


@dataclass
class MlfqQueue:
    """Multi-level feedback queue.

    New tasks enter the top level; a task that uses its whole slice drops one level (slices
    double per level); every ``boost_period_s`` all tasks return to the top, so long tasks
    are not starved.
    """

    levels: int = 3
    base_slice_s: float = 0.1
    boost_period_s: float = 5.0
    _queues: list[deque[Task]] = field(default_factory=list)
    _level: dict[str, int] = field(default_factory=dict)
    _last_boost: float = 0.0

    def __post_init__(self) -> None:
        if self.levels < 1 or self.base_slice_s <= 0 or self.boost_period_s <= 0:
            raise ValueError("levels, base_slice_s and boost_period_s must be positive")
        self._queues = [deque() for _ in range(self.levels)]

    def slice_at(self, level: int) -> float:
        return float(self.base_slice_s * 2**level)

    def push(self, task: Task, now: float) -> None:
        self._level[task.task_id] = 0
        self._queues[0].append(task)

    def pop(self, now: float) -> tuple[Task, float | None] | None:
        if now - self._last_boost >= self.boost_period_s:
            self._boost(now)
        for level, queue in enumerate(self._queues):
            if queue:
                return queue.popleft(), self.slice_at(level)
        return None

    def requeue(self, task: Task, used_s: float, now: float) -> None:
        level = self._level.get(task.task_id, 0)
        if used_s >= self.slice_at(level) - 1e-12:
            level = min(level + 1, self.levels - 1)
        self._level[task.task_id] = level
        self._queues[level].append(task)

    def level_of(self, task_id: str) -> int:
        return self._level[task_id]

    def _boost(self, now: float) -> None:
        self._last_boost = now
        for queue in self._queues[1:]:
            while queue:
                task = queue.popleft()
                self._level[task.task_id] = 0
                self._queues[0].append(task)

    def tasks(self) -> list[Task]:
        return [task for queue in self._queues for task in queue]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)


QUEUES: dict[str, Callable[[], TaskQueue]] = {
    "fcfs": fcfs_queue,
    "sjf": sjf_queue,
    "priority": priority_queue,
    "round_robin_slice": RoundRobinQueue,
    "mlfq": MlfqQueue,
}
