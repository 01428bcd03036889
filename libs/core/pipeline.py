"""filter → score → weight → pick over a ``FleetState``, for one profile, vectorised.

``prepare`` computes the static parts (fleet-only filters, scores and multipliers) once per
cycle; ``refresh`` recomputes the static parts of the one device a placement changed. ``pick``
finds a task's best device: on a fleet grouped into blocks (``FleetState.blocks``) by a search
that scores only the blocks that can hold it (``libs/core/search.py``), else by scoring every
device (``best``). Both give the same device and score: a device's score is computed the same
way, value by value in float64, whichever devices are scored with it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from libs.contracts.profiles import Profile
from libs.core.fleet_state import F64, At, Bool, FleetState
from libs.core.model import Task
from libs.core.plugins import resolve
from libs.core.search import BlockSearch


@dataclass(frozen=True, slots=True)
class DeviceVerdict:
    """One device's verdict for one task: a score, or the reason it was filtered."""

    device_id: str
    feasible: bool
    score: float | None
    reason: str | None


class Pipeline:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        filters, scores, multipliers = resolve(profile)
        self.static_filters = [f for f in filters if f.static]
        self.task_filters = [f for f in filters if not f.static]
        self.static_scores = [(s, w) for s, w in scores if s.static and w > 0]
        self.task_scores = [(s, w) for s, w in scores if not s.static and w > 0]
        self.multipliers = multipliers
        self.fleet: FleetState | None = None
        self.search: BlockSearch | None = None
        self.static_scaled: F64 = np.zeros(0)
        self.task_scale: list[F64] = []
        self.filter_values: list[Bool] = []
        self.score_values: list[F64] = []
        self.multiplier_values: list[F64] = []

    # -- static parts ---------------------------------------------------------------------
    def prepare(self, fleet: FleetState) -> None:
        self.fleet = fleet
        everything = slice(None)
        n = len(fleet)
        self.filter_values = [f.mask(fleet, None, everything) for f in self.static_filters]
        self.score_values = [
            s.values(fleet, None, self.profile, everything) for s, _ in self.static_scores
        ]
        self.multiplier_values = [
            m.values(fleet, None, self.profile, everything) for m in self.multipliers
        ]
        self.static_mask = np.ones(n, dtype=bool)
        self.static_score = np.zeros(n)
        self.factor = np.ones(n)
        self.static_scaled = np.zeros(n)
        self.task_scale = [np.zeros(n) for _ in self.task_scores]
        self._combine(everything)
        #: What ``refresh`` recomputes: the volatile plugins, with the arrays they fill.
        filters = zip(self.static_filters, self.filter_values, strict=True)
        self.volatile_filters = [(f, mask) for f, mask in filters if f.volatile]
        self.volatile_scores = [
            (s, values)
            for s, values in zip(
                [s for s, _ in self.static_scores] + self.multipliers,
                self.score_values + self.multiplier_values,
                strict=True,
            )
            if s.volatile
        ]
        self.search = None
        if fleet.blocks is not None and BlockSearch.supports(self):
            self.search = BlockSearch(self, fleet, fleet.blocks)

    def _combine(self, at: slice) -> None:
        """Combine stored plugin values; fold weights and multipliers so that a task's score
        is ``static_scaled + Σ task_score_k × task_scale_k``."""
        self.static_mask[at] = True
        for mask in self.filter_values:
            self.static_mask[at] &= mask[at]
        self.static_score[at] = 0.0
        for values, (_, weight) in zip(self.score_values, self.static_scores, strict=True):
            self.static_score[at] += weight * values[at]
        self.factor[at] = 1.0
        for values in self.multiplier_values:
            self.factor[at] *= values[at]
        self.static_scaled[at] = self.static_score[at] * self.factor[at]
        for k, (_, weight) in enumerate(self.task_scores):
            self.task_scale[k][at] = weight * self.factor[at]

    def refresh(self, i: int) -> None:
        """Recompute the volatile static values of device ``i`` after its state changed."""
        fleet = self._fleet()
        for f, mask in self.volatile_filters:
            mask[i] = f.mask(fleet, None, i)
        for s, values in self.volatile_scores:
            values[i] = s.values(fleet, None, self.profile, i)
        # The same combination as ``_combine``, in scalars: a one-element slice costs more.
        passes = all(mask[i] for mask in self.filter_values)
        self.static_mask[i] = passes
        score = 0.0
        for values, (_, weight) in zip(self.score_values, self.static_scores, strict=True):
            score += weight * float(values[i])
        factor = 1.0
        for values in self.multiplier_values:
            factor *= float(values[i])
        scaled = score * factor
        self.static_score[i], self.factor[i], self.static_scaled[i] = score, factor, scaled
        scales = [weight * factor for _, weight in self.task_scores]
        for scale, value in zip(self.task_scale, scales, strict=True):
            scale[i] = value
        if self.search is not None:
            self.search.changed(i, scaled if passes else -np.inf, scales)

    # -- per task -------------------------------------------------------------------------
    def feasible(self, task: Task) -> Bool:
        fleet = self._fleet()
        mask = self.static_mask.copy()
        for f in self.task_filters:
            mask &= f.mask(fleet, task, slice(None))
        return mask

    def scores(self, task: Task, at: At = slice(None)) -> F64:
        """Σ w_k·score_k × multipliers, for every device (feasible or not) or those ``at``."""
        fleet = self._fleet()
        total = self.static_scaled[at].copy()
        for (s, _), scale in zip(self.task_scores, self.task_scale, strict=True):
            total += s.values(fleet, task, self.profile, at) * scale[at]
        return total

    def best(self, task: Task, feasible: Bool) -> tuple[int | None, float]:
        """The highest-scoring device among ``feasible``, or (None, 0.0)."""
        scores = self.scores(task)
        np.copyto(scores, -np.inf, where=~feasible)
        if len(scores) == 0:
            return None, 0.0
        index = int(np.argmax(scores))
        if scores[index] == -np.inf:
            return None, 0.0
        return index, float(scores[index])

    def pick(self, task: Task) -> tuple[int | None, float]:
        """The best feasible device's index and score, or (None, 0.0); ties go to the lowest
        index. Searches the blocks when the fleet has them, else scores every device."""
        if self.search is not None:
            return self.search.pick(task)
        return self.best(task, self.feasible(task))

    def why_not(self, task: Task) -> str:
        """Why no device can take ``task``: rejection counts by the first failing filter."""
        fleet = self._fleet()
        if len(fleet) == 0:
            return "no devices"
        counts = Counter(v.reason for v in self.explain(task) if v.reason)
        detail = ", ".join(f"{reason} ({n})" for reason, n in counts.most_common())
        return f"no device fits: {detail}"

    def explain(self, task: Task) -> list[DeviceVerdict]:
        """Every device's verdict: the first filter that rejects it, else its score."""
        fleet = self._fleet()
        everything = slice(None)
        first_reason: list[str | None] = [None] * len(fleet)
        for f in self.static_filters + self.task_filters:
            rejected = ~f.mask(fleet, task, everything)
            for i in np.flatnonzero(rejected):
                if first_reason[i] is None:
                    first_reason[i] = f.name
        scores = self.scores(task)
        return [
            DeviceVerdict(
                device_id,
                reason is None,
                float(scores[i]) if reason is None else None,
                reason,
            )
            for i, (device_id, reason) in enumerate(zip(fleet.ids, first_reason, strict=True))
        ]

    def _fleet(self) -> FleetState:
        if self.fleet is None:
            raise RuntimeError("Pipeline.prepare(fleet) must be called first")
        return self.fleet
