"""Scheduling profiles: the weights of each mode, as configuration rather than code.

A profile names its mode, the task-priority weights (α urgency, β complexity), the score
plugin weights (γ device_match, δ completion — the load in time units — and the capability
total), the dimension weights
w1–w5 used for the capability total, and the plugin lists. It travels in ``PUT /policy`` and
in checkpoints, and is validated once. The built-in profiles are in ``libs/core/profiles.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libs.contracts.base import Mode

Weight = Annotated[float, Field(ge=0.0, le=10.0)]


class DimensionWeights(BaseModel):
    """w1..w5 of the total score; they must sum to 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    compute: Weight
    memory: Weight
    efficiency: Weight
    network: Weight
    stability: Weight

    @model_validator(mode="after")
    def _sum_to_one(self) -> DimensionWeights:
        if abs(sum(self.as_tuple()) - 1.0) > 1e-6:
            raise ValueError("dimension weights must sum to 1")
        return self

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.compute, self.memory, self.efficiency, self.network, self.stability)


class Profile(BaseModel):
    """One scheduling profile. ``scores`` maps score plugin name → weight."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    mode: Mode
    urgency: Weight  # α
    complexity: Weight  # β
    dimensions: DimensionWeights
    filters: tuple[str, ...] = ("alive", "memory", "power", "thermal", "battery_floor")
    scores: dict[str, Weight] = Field(
        default_factory=lambda: {"device_match": 0.2, "capability": 0.1, "completion": 0.7}
    )
    multipliers: tuple[str, ...] = ("battery", "thermal_backoff")
    #: The mode's power policy: how long a device left without work stays awake before it
    #: sleeps (``libs/core/energy.py``: 30 s by default, the break-even time in energy mode).
    sleep_after_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 30.0

    @property
    def match_weight(self) -> float:  # γ
        return self.scores.get("device_match", 0.0)

    @property
    def load_weight(self) -> float:  # δ: the load in time units, or the queue length (``load``)
        return self.scores.get("completion", 0.0) + self.scores.get("load", 0.0)


def load_profile(data: dict[str, Any]) -> Profile:
    """Validate a profile from a parsed YAML/JSON mapping. Raises ``pydantic.ValidationError``."""
    return Profile.model_validate(data)
