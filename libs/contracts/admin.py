"""Bodies of the admin API: the scheduler serves them, the gateway documents and forwards them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libs.contracts import Mode
from libs.contracts.base import Precision
from libs.contracts.models import MODEL_NAME_PATTERN, ModelCard
from libs.contracts.profiles import Profile

#: The scheduling policies a scheduler knows (``libs/core/policies.py`` builds each one; a test
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
    #: None: the scheduler's default (``ModelDeployment.context_length``).
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    max_shards: Annotated[int, Field(ge=1, le=256)] = 8
    #: Copies of the model; each request goes to one, chosen by the active policy.
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    #: Weights' precision on the CPU shard engine (default: the model's, int8 for SmolLM2).
    precision: Precision | None = None
    #: Exactly this many shards per copy (default: the scheduler chooses up to max_shards).
    shards: Annotated[int, Field(ge=1, le=256)] | None = None
    #: Exactly these devices, in pipeline order (default: the scheduler chooses).
    devices: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")], ...] = Field(
        default=(), max_length=256
    )


class PreviewBody(BaseModel):
    """Previews of a model not registered (yet): its ``card``, read by the caller where its
    file lies (``tessera preview FILE.gguf``). Nothing is registered or stored."""

    model_config = ConfigDict(extra="forbid")
    card: ModelCard
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    max_shards: Annotated[int, Field(ge=1, le=256)] = 8
    precision: Precision | None = None

    @field_validator("card")
    @classmethod
    def one_size_per_layer(cls, card: ModelCard) -> ModelCard:
        for field in ("layer_bytes", "layer_params"):  # one entry per layer
            if (count := len(getattr(card, field))) != card.layers:
                raise ValueError(f"card.{field}: {count} entries for {card.layers} layers")
        return card


class AddModelBody(BaseModel):
    """Register a model: ``source`` is read by the scheduler on its host (a path to a GGUF;
    a URL or ``hf:ORG/REPO[/FILE]`` is fetched first), or ``card`` was read by the caller on
    its own host (``tessera models add`` reads the file where it lies)."""

    model_config = ConfigDict(extra="forbid")
    source: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    card: ModelCard | None = None
    name: Annotated[str, Field(pattern=MODEL_NAME_PATTERN)] | None = None
    #: The sha256 the file must have (its publisher's): a file that differs is refused.
    sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")] | None = None


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
