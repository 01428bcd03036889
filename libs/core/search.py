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

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from libs.contracts.profiles import Profile
from libs.core.blocks import FleetBlocks, Index
from libs.core.fleet_state import F64, Bool, FleetState, service_seconds
from libs.core.model import Task
from libs.core.plugins import COMPLETION_SLACK, Score, unit, within_slack

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


class PipelineView(Protocol):
    """What of a profile's pipeline the search reads (``libs/core/pipeline.Pipeline``, which
    builds a ``BlockSearch`` over itself once its static parts are prepared)."""

    @property
    def profile(self) -> Profile: ...
    @property
    def task_scores(self) -> Sequence[tuple[Score, float]]:
        """The task-dependent scores the profile weighs (weight above 0)."""

    @property
    def static_mask(self) -> Bool:
        """Per device: every fleet-only filter passes."""

    @property
    def static_scaled(self) -> F64:
        """Per device: the fleet-only scores, weighted, times the multipliers."""

    @property
    def task_scale(self) -> Sequence[F64]:
        """Per task-dependent score, per device: its weight times the multipliers."""


class BlockSearch:
    """Per-block bounds of one pipeline's values over one fleet, in the fleet's blocks.

    ``table`` holds, in block order, the static part (-inf where a static filter refuses the
    device, so that no task goes there) and one weight × multiplier row per task-dependent
    score; the fleet's own values are in ``FleetBlocks.table``.
    """

    @staticmethod
    def supports(pipeline: PipelineView) -> bool:
        """Whether every plugin of the pipeline's profile has a bound here. ``alive`` must be
        among the filters: the fleet's bounds cover live devices only."""
        filters = set(pipeline.profile.filters)
        scores = {s.name for s, _ in pipeline.task_scores}
        return "alive" in filters and filters <= BOUNDED_FILTERS and scores <= BOUNDED_SCORES

    def __init__(self, pipeline: PipelineView, fleet: FleetState, blocks: FleetBlocks) -> None:
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
        self._is_match = [name == "device_match" for name in self.score_names]
        self._memory = "memory" in self.filters
        #: Both intensity filters at once, by ``allowed_intensity`` (the usual case).
        self._intensity = "power" in self.filters and "thermal" in self.filters
        self._power = "power" in self.filters and not self._intensity
        self._heat = "thermal" in self.filters and not self._intensity
        self._slack = "completion_slack" in self.filters

    def _optimistic(self, table: F64) -> F64:
        """The static part plus each match's weight: a score with every match at its most."""
        total = table[0].copy()
        for k, name in enumerate(self.score_names):
            if name == "device_match":
                total += table[1 + k]
        return np.asarray(total, dtype=np.float64)

    def changed(self, i: int, static: float, scales: list[float]) -> None:
        """Device ``i`` took a task: its static part (-inf where a static filter refuses it)
        and its weight × multiplier per task-dependent score are now ``static`` and
        ``scales``. Update its row, widen its block's bounds to cover it (in plain floats:
        this runs once per placement, on one device)."""
        flat = self._flat
        b, s = int(self.blocks.blocks.of[i]), int(self.blocks.blocks.slot[i])
        optimistic = static
        flat[0, s] = static
        if static > self.static[b]:
            self.static[b] = static
        for k, (bound, value) in enumerate(zip(self.scale, scales, strict=True)):
            flat[1 + k, s] = value
            if value > bound[b]:
                bound[b] = value
            if self._is_match[k]:  # as ``_optimistic`` adds it
                optimistic += value
        flat[-1, s] = optimistic
        if optimistic > self.optimistic[b]:
            self.optimistic[b] = optimistic

    def bounds(self, task: Task, demand: F64, floor: F64 | None, earliest: float) -> F64:
        """Each block's highest possible score for ``task`` (-inf: no device can take it);
        ``demand`` is its unit demand, ``floor`` and ``earliest`` the fleet's completion floor
        and earliest completion for it (when the profile is timed)."""
        blocks = self.blocks
        refuse: Bool | None = None
        if self._memory:
            refuse = blocks.memory < task.memory_gb
        if self._intensity:
            refuse = _or(refuse, blocks.allow < task.intensity)
        if self._power:
            refuse = _or(refuse, blocks.power < task.intensity)
        if self._heat:
            refuse = _or(refuse, blocks.heat <= task.intensity)
        if floor is not None and self._slack:
            refuse = _or(refuse, floor > COMPLETION_SLACK * earliest + 1e-9)
        # Two bounds, the lower kept: each part at its block's most, or the static part and
        # the match's weight together at their most (one device's, so tighter) with the
        # match at 1.
        bound, together = self.static, self.optimistic
        for is_match, scale in zip(self._is_match, self.scale, strict=True):
            if is_match:
                bound = bound + scale * np.minimum(blocks.capability @ demand, 1.0)
            else:
                assert floor is not None
                reach = scale * (max(earliest, 1e-12) / np.maximum(floor, 1e-12))  # best_over
                bound = bound + reach
                together = together + reach
        bound = np.minimum(bound, together)
        if refuse is not None:
            bound[refuse] = -np.inf
        return bound

    def pick(self, task: Task) -> tuple[int | None, float]:
        """The best feasible device's index and score, or (None, 0.0): what
        ``Pipeline.best(task, Pipeline.feasible(task))`` returns."""
        demand = np.array(unit(task.demand))
        floor: F64 | None = None
        earliest = 0.0
        if self.timed:
            floor = self.fleet.completion_floor(task)
            earliest = self.fleet.earliest_s(task, floor)
        bound = self.bounds(task, demand, floor, earliest)
        ranked = np.argsort(-bound, kind="stable")
        ranked_bound = bound[ranked]
        column = demand[:, None]
        best_score, best_index = -np.inf, -1
        start, width, count = 0, FIRST_BLOCKS, len(ranked)
        while start < count and ranked_bound[start] > -np.inf:
            if best_score == -np.inf:  # nothing found yet: the next most promising blocks
                end, width = start + width, width * 2
            else:  # every block that could still reach the best, at once (bounds descend)
                end = start + int(np.count_nonzero(ranked_bound[start:] >= best_score - ROUNDING))
                if end == start:
                    break
            score, index = self._score(task, column, earliest, ranked[start:end], best_score)
            if score > best_score or (score == best_score and index < best_index):
                best_score, best_index = score, index
            start = end
        return (None, 0.0) if best_index < 0 else (best_index, best_score)

    def _score(
        self, task: Task, demand: F64, earliest: float, blocks: Index, reach: float
    ) -> tuple[float, int]:
        """The best score on ``blocks``' feasible devices and its lowest index, or (-inf, -1);
        ``demand`` is the task's unit demand as a column. Devices that cannot ``reach`` a
        score are left out before the costlier parts. Each value is computed as the plugins
        compute it (``cosine``, ``best_over``, ``service_seconds``), operation by operation."""
        listed = blocks.tolist()
        low, high = min(listed), max(listed) + 1
        # Blocks go fastest first and the best bounds are mostly the fastest blocks': a run of
        # blocks is read in place (the few between that were not asked for cost less than a
        # copy, and scoring a block twice or unasked changes no answer).
        size = self.blocks.blocks.size
        if high - low <= 2 * len(listed):
            columns: slice | Index = slice(low * size, high * size)
        else:
            columns = (blocks[:, None] * size + np.arange(size)).ravel()
        fb = FleetBlocks
        own = self.blocks.flat[:, columns]
        mine = self._flat[:, columns]
        finish: F64 | None = None
        ratio: F64 | None = None  # ``best_over(earliest, finish)``
        if self.timed:
            if task.output_tokens <= 0:  # ``service_seconds`` without its mask
                finish = own[fb.BACKLOG] + task.work / own[fb.SPEED]
            else:
                finish = own[fb.BACKLOG] + service_seconds(
                    task, own[fb.SPEED], own[fb.PREFILL], own[fb.DECODE]
                )
            if self.completion is not None:
                ratio = max(earliest, 1e-12) / np.maximum(finish, 1e-12)
        if reach > -np.inf:  # first a bound per device: the match at most 1, the rest exact
            optimistic = mine[-1]
            if ratio is not None:
                optimistic = optimistic + ratio * mine[self.completion]
            keep = (optimistic >= reach - ROUNDING).nonzero()[0]
            if keep.size == 0:
                return -np.inf, -1
            own, mine = own[:, keep], mine[:, keep]
            if finish is not None and self._slack:
                finish = finish[keep]
            if ratio is not None:
                ratio = ratio[keep]
        ok: Bool | None = None
        if self._memory:
            ok = own[fb.MEMORY] >= task.memory_gb
        if self._intensity:
            ok = _and(ok, own[fb.ALLOW] >= task.intensity)
        if self._power:
            ok = _and(ok, own[fb.POWER] >= task.intensity)
        if self._heat:
            ok = _and(ok, own[fb.HEAT] > task.intensity)
        if finish is not None and self._slack:
            ok = _and(ok, within_slack(finish, earliest))
        total = mine[0]  # -inf where a static filter refuses
        for k, is_match in enumerate(self._is_match):
            if is_match:  # ``cosine``: the products at once, summed one dimension at a time
                products = own[fb.CAPABILITY] * demand
                values = products[0] + products[1]
                for d in range(2, len(products)):
                    values += products[d]
            else:
                assert ratio is not None
                values = ratio
            total = total + values * mine[1 + k]
        if ok is not None:
            total = np.where(ok, total, -np.inf)
        best = int(total.argmax())
        top = float(total[best])
        if top == -np.inf:
            return top, -1
        ties = total == top
        if np.count_nonzero(ties) == 1:  # the usual case: no other device scores the same
            return top, int(own[fb.INDEX, best])
        return top, int(own[fb.INDEX][ties].min())


def _and(mask: Bool | None, more: Bool) -> Bool:
    if mask is None:
        return more
    mask &= more
    return mask


def _or(mask: Bool | None, more: Bool) -> Bool:
    if mask is None:
        return more
    mask |= more
    return mask
