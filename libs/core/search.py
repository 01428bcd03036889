"""The best device for a task without scoring the whole fleet: branch and bound over blocks.

``Pipeline.best(task, pipeline.feasible(task))`` scores every device. ``BlockSearch.pick``
returns the same device and score (ties to the lowest index, as ``argmax`` breaks them) while
scoring only the blocks (``libs/core/blocks.py``) whose bound reaches the best score found so
far. A block's bound adds, for each part of the score, the most any of its devices can have:
the largest static part, the largest weight × multiplier of each task-dependent score, times
the most that score can reach in the block — a cosine match no higher than the block's largest
capability per dimension allows, a completion ratio no higher than the earliest completion ÷
the block's completion floor. Blocks where no device could pass a filter (memory, power, heat,
completion slack) are left out whole.

The values a block's devices are scored on sit in one table laid out block by block, so that a
set of blocks is read in one step; they are scored with the plugins' own functions
(``service_seconds``, ``cosine``, ``best_over``, ``within_slack``), value by value as the
plugins score the whole fleet. The search handles the plugins it has bounds for;
``BlockSearch.supports`` says whether a profile's plugins are all among them (the pipeline
scores every device otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from libs.core.blocks import FleetBlocks, Index
from libs.core.fleet import F64, Bool, FleetState, service_seconds
from libs.core.model import Task
from libs.core.plugins import COMPLETION_SLACK, best_over, cosine, unit, within_slack

if TYPE_CHECKING:
    from libs.core.pipeline import Pipeline

#: Filters the search bounds per block (the static ones are folded into the static part).
BOUNDED_FILTERS = {"alive", "battery_floor", "memory", "power", "thermal", "completion_slack"}
#: Task-dependent scores it bounds.
BOUNDED_SCORES = {"device_match", "completion"}
#: Absolute room for rounding between a bound and a score (scores are sums of a few terms of
#: order 1, each rounded to 1e-16; a block within this of the best is scored, not skipped).
ROUNDING = 1e-9
#: Blocks scored first (most promising first); scoring a block costs little beside the fixed
#: cost of a step, and with a few blocks the first step usually settles the search.
FIRST_BLOCKS = 4


class BlockSearch:
    """Per-block bounds of one pipeline's values over one fleet, in the fleet's blocks.

    ``table`` holds, in block order, the static part (-inf where a static filter refuses the
    device, so that no task goes there) and one weight × multiplier row per task-dependent
    score; the fleet's own values are in ``FleetBlocks.table``.
    """

    @staticmethod
    def supports(pipeline: Pipeline) -> bool:
        """Whether every plugin of the pipeline's profile has a bound here. ``alive`` must be
        among the filters: the fleet's bounds cover live devices only."""
        filters = set(pipeline.profile.filters)
        scores = {s.name for s, _ in pipeline.task_scores}
        return "alive" in filters and filters <= BOUNDED_FILTERS and scores <= BOUNDED_SCORES

    def __init__(self, pipeline: Pipeline, fleet: FleetState, blocks: FleetBlocks) -> None:
        self.pipeline, self.fleet, self.blocks = pipeline, fleet, blocks
        self.filters = set(pipeline.profile.filters)
        self.score_names = [s.name for s, _ in pipeline.task_scores]
        members = blocks.blocks.members
        self.timed = "completion" in self.score_names or "completion_slack" in self.filters
        #: The completion's weight row in ``table``, if the profile weighs it.
        names = self.score_names
        self.completion = 1 + names.index("completion") if "completion" in names else None
        static = np.where(pipeline.static_mask, pipeline.static_scaled, -np.inf)
        self.table = np.stack([static, *pipeline.task_scale, static])[:, members]
        self.table[0][blocks.blocks.padding] = -np.inf  # a repeated device is scored once
        self.table[-1] = self._optimistic(self.table)
        self._flat = self.table.reshape(len(self.table), -1)
        self.static: F64 = self.table[0].max(axis=1)
        self.optimistic: F64 = self.table[-1].max(axis=1)
        usable = self.table[0] > -np.inf
        self.scale = [np.where(usable, row, -np.inf).max(axis=1) for row in self.table[1:-1]]

    def _optimistic(self, table: F64) -> F64:
        """The static part plus each match's weight: a score with every match at its most."""
        total = table[0].copy()
        for k, name in enumerate(self.score_names):
            if name == "device_match":
                total += table[1 + k]
        return np.asarray(total, dtype=np.float64)

    def changed(self, i: int) -> None:
        """Device ``i`` took a task: update its row, widen its block's bounds to cover it."""
        pipeline = self.pipeline
        b, row = self.blocks.blocks.of[i], self._flat[:, self.blocks.blocks.slot[i]]
        static = float(pipeline.static_scaled[i]) if pipeline.static_mask[i] else -np.inf
        optimistic = static
        row[0] = static
        self.static[b] = max(self.static[b], static)
        for k, (bound, scale) in enumerate(zip(self.scale, pipeline.task_scale, strict=True)):
            value = float(scale[i])
            row[1 + k] = value
            bound[b] = max(bound[b], value)
            if self.score_names[k] == "device_match":  # as ``_optimistic`` adds it
                optimistic += value
        row[-1] = optimistic
        self.optimistic[b] = max(self.optimistic[b], optimistic)

    def bounds(self, task: Task, demand: tuple[float, ...]) -> F64:
        """Each block's highest possible score for ``task`` (-inf: no device can take it)."""
        fleet, blocks = self.fleet, self.blocks
        bound = self.static.copy()
        if "memory" in self.filters:
            bound[blocks.memory < task.memory_gb] = -np.inf
        if "power" in self.filters:
            bound[blocks.power < task.intensity] = -np.inf
        if "thermal" in self.filters:
            bound[blocks.heat <= task.intensity] = -np.inf
        if "completion" in self.score_names or "completion_slack" in self.filters:
            floor = fleet.completion_floor(task)
            earliest = fleet.earliest_s(task, floor)
            if "completion_slack" in self.filters:
                bound[floor > COMPLETION_SLACK * earliest + 1e-9] = -np.inf
        # Two bounds, the lower kept: each part at its block's most, or the static part and
        # the match's weight together at their most (one device's, so tighter) with the
        # match at 1.
        together = self.optimistic.copy()
        for name, scale in zip(self.score_names, self.scale, strict=True):
            if name == "device_match":
                bound += scale * np.minimum(blocks.capability @ np.asarray(demand), 1.0)
            else:
                reach = scale * best_over(earliest, floor)
                bound += reach
                together += reach
        return np.asarray(np.minimum(bound, together), dtype=np.float64)

    def pick(self, task: Task) -> tuple[int | None, float]:
        """The best feasible device's index and score, or (None, 0.0): what
        ``Pipeline.best(task, Pipeline.feasible(task))`` returns."""
        demand = unit(task.demand)
        bound = self.bounds(task, demand)
        ranked = np.argsort(-bound, kind="stable")
        ranked_bound = bound[ranked]
        best_score, best_index = -np.inf, -1
        start, width = 0, FIRST_BLOCKS
        while start < len(ranked) and ranked_bound[start] > -np.inf:
            if best_score == -np.inf:  # nothing found yet: the next most promising blocks
                end, width = start + width, width * 2
            else:  # every block that could still reach the best, at once (bounds descend)
                end = start + int(np.count_nonzero(ranked_bound[start:] >= best_score - ROUNDING))
                if end == start:
                    break
            score, index = self._score(task, demand, ranked[start:end], best_score)
            if score > best_score or (score == best_score and index < best_index):
                best_score, best_index = score, index
            start = end
        return (None, 0.0) if best_index < 0 else (best_index, best_score)

    def _score(
        self, task: Task, demand: tuple[float, ...], blocks: Index, reach: float
    ) -> tuple[float, int]:
        """The best score on ``blocks``' feasible devices and its lowest index, or (-inf, -1).
        Devices that cannot ``reach`` a score are left out before the costlier parts."""
        low, high = int(blocks.min()), int(blocks.max()) + 1
        # Blocks go fastest first and the best bounds are mostly the fastest blocks': a run of
        # blocks is read in place (the few between that were not asked for cost less than a
        # copy, and scoring a block twice or unasked changes no answer).
        at: slice | Index = slice(low, high) if high - low <= 2 * len(blocks) else blocks
        fb = FleetBlocks
        own = self.blocks.table[:, at].reshape(len(self.blocks.table), -1)
        mine = self.table[:, at].reshape(len(self.table), -1)
        finish: F64 | None = None
        if self.timed:
            service = service_seconds(task, own[fb.SPEED], own[fb.PREFILL], own[fb.DECODE])
            finish = own[fb.BACKLOG] + service
            earliest = self.fleet.earliest_s(task)
        if reach > -np.inf:  # first a bound per device: the match at most 1, the rest exact
            optimistic = mine[-1]
            if finish is not None and self.completion is not None:
                optimistic = optimistic + best_over(earliest, finish) * mine[self.completion]
            keep = np.flatnonzero(optimistic >= reach - ROUNDING)
            if keep.size == 0:
                return -np.inf, -1
            own, mine = own[:, keep], mine[:, keep]
            finish = None if finish is None else finish[keep]
        ok = own[fb.MEMORY] >= task.memory_gb if "memory" in self.filters else None
        if "power" in self.filters:
            ok = _and(ok, own[fb.POWER] >= task.intensity)
        if "thermal" in self.filters:
            ok = _and(ok, own[fb.HEAT] > task.intensity)
        if finish is not None and "completion_slack" in self.filters:
            ok = _and(ok, within_slack(finish, earliest))
        total = mine[0]  # -inf where a static filter refuses
        for k, name in enumerate(self.score_names):
            if name == "device_match":
                values = cosine(own[fb.CAPABILITY], demand)
            else:
                assert finish is not None
                values = best_over(earliest, finish)
            total = total + values * mine[1 + k]
        if ok is not None:
            total = np.where(ok, total, -np.inf)
        top = float(total.max())
        if top == -np.inf:
            return top, -1
        return top, int(own[fb.INDEX][total == top].min())


def _and(mask: Bool | None, more: Bool) -> Bool:
    return more if mask is None else mask & more
