"""Bodies of the admin API: the scheduler serves them, the gateway documents and forwards them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.contracts import Mode
from libs.contracts.base import Precision
from libs.contracts.profiles import Profile

#: The scheduling policies a scheduler knows (``libs/core/registry.py`` builds each one; a test
#: keeps the two lists equal).
POLICY_NAMES = (
    "dwps",
    "random",
    "round_robin",
    "weighted_round_robin",
    "least_connections",
    "power_of_two",
    "source_hash",
    "consistent_hash",
    "fcfs",
    "sjf",
    "priority",
    "round_robin_slice",
    "mlfq",
    "static",
    "dynamic",
    "priority_allocation",
    "market",
    "fair_share",
    "ilp",
)


class DeployBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    deployment_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] = 2048
    max_shards: Annotated[int, Field(ge=1, le=256)] = 8
    #: Copies of the model; each request goes to one, chosen by the active policy.
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    #: Weights' precision on the CPU shard engine (default: the model's, int8 for SmolLM2).
    precision: Precision | None = None


class ModeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Mode | Literal["auto"]


class PolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: Annotated[str, Field(json_schema_extra={"enum": sorted(POLICY_NAMES)})]
    profile: Profile | None = None

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; known: {sorted(POLICY_NAMES)}")
        return value
