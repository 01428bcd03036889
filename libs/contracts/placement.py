"""Placement messages: a task the scheduler is asked to place (an inference request, a model
deployment, a batch job), what it needs (``Demand``), and the scheduler's decision
(``PlacementDecision``: one ``Assignment`` per device and its layers, or why the task could not
be placed)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from libs.contracts.base import (
    DeploymentId,
    DeviceId,
    Fraction,
    Mode,
    ModelName,
    Precision,
    RequestId,
    Timestamp,
    WireModel,
)

JsonScalar = str | int | float | bool | None


class Demand(WireModel):
    """What a task needs along the five capability dimensions, each in [0, 1].

    The scheduler matches it against a device's capability vector by cosine similarity, so
    only its direction matters; an all-zero demand is refused because it has no direction.
    """

    compute: Fraction
    memory: Fraction
    efficiency: Fraction
    network: Fraction
    stability: Fraction

    @model_validator(mode="after")
    def _not_zero(self) -> Demand:
        if self.compute + self.memory + self.efficiency + self.network + self.stability == 0:
            raise ValueError("demand must not be all zero")
        return self


class InferenceRequest(WireModel):
    kind: Literal["inference"] = "inference"
    request_id: RequestId
    #: The model the user asked for, by name (or a deployment id).
    model: ModelName
    #: The deployment that name resolved to where the sender resolved it (the gateway, with
    #: ``libs.deployments.resolve``); None: the scheduler resolves ``model`` by the same rule.
    deployment_id: DeploymentId | None = None
    prompt_tokens: Annotated[int, Field(ge=0, le=1_000_000)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    urgency: Fraction = 0.5
    source: Annotated[str, Field(max_length=200)] = ""
    deadline_ts: Timestamp | None = None
    demand: Demand | None = None


class ModelDeployment(WireModel):
    kind: Literal["deployment"] = "deployment"
    deployment_id: DeploymentId
    model: ModelName
    #: Tokens of context each request may use (None: ``DEFAULT_CONTEXT_TOKENS`` at most,
    #: lowered to what the model and its workers allow: docs/models.md).
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    max_shards: Annotated[int, Field(ge=1, le=256)] = 8
    urgency: Fraction = 0.5
    #: Copies of the model, each placed on its own devices where the fleet allows; each
    #: request goes to one of them, chosen by the active policy (``<id>``, ``<id>-r2``, …).
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    #: Weights' precision on the CPU shard engine (None: the model's default, int8 for the
    #: models the CPU workers serve); the placement counts each layer's bytes in it.
    precision: Precision | None = None
    #: Told: exactly this many shards per copy (None: the scheduler chooses, up to
    #: ``max_shards``), and exactly these devices, in pipeline order (empty: it chooses).
    shard_count: Annotated[int, Field(ge=1, le=256)] | None = None
    devices: tuple[DeviceId, ...] = Field(default=(), max_length=256)


class BatchJob(WireModel):
    kind: Literal["job"] = "job"
    job_id: RequestId
    task_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.]{1,128}$")]
    work_gflop: Annotated[float, Field(gt=0.0, le=1e15)]
    memory_gb: Annotated[float, Field(ge=0.0, le=65536.0)]
    gpus: Annotated[int, Field(ge=0, le=1024)] = 0
    urgency: Fraction = 0.5
    deadline_ts: Timestamp | None = None
    args: dict[Annotated[str, Field(max_length=64)], JsonScalar] = Field(
        default_factory=dict, max_length=64
    )


Task = Annotated[InferenceRequest | ModelDeployment | BatchJob, Field(discriminator="kind")]


class PlacementRequest(WireModel):
    """Ask the scheduler to place one task; it is decided in the next decision cycle."""

    task: Task
    ts: Timestamp

    @property
    def task_id(self) -> str:
        task = self.task
        if isinstance(task, InferenceRequest):
            return task.request_id
        if isinstance(task, ModelDeployment):
            return task.deployment_id
        return task.job_id


class Assignment(WireModel):
    """One device's part of a placement. Layers are the half-open range [layer_start, layer_end)."""

    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)] = 0
    layer_start: Annotated[int, Field(ge=0)] = 0
    layer_end: Annotated[int, Field(ge=0)] = 0
    #: Host memory the shard holds there, and GPU memory (VRAM, counted apart) it holds besides
    #: for its last ``gpu_layers`` layers (``libs/core/partition.py: gpu_part``).
    memory_gb: Annotated[float, Field(ge=0.0)] = 0.0
    vram_gb: Annotated[float, Field(ge=0.0)] = 0.0
    gpu_layers: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _range(self) -> Assignment:
        if self.layer_end < self.layer_start:
            raise ValueError("layer_end must not be below layer_start")
        return self


class PlacementDecision(WireModel):
    """The scheduler's answer: where the task goes, or why it could not be placed.

    ``task_id`` is always the id of the task it answers, of the type ``kind`` names (an
    inference request's ``request_id``, a deployment's ``deployment_id``, a job's ``job_id``);
    ``deployment_id`` is always the deployment whose shards ``assignments`` lists (the one
    deployed, or the replica an inference request was routed to), None for a job."""

    task_id: RequestId
    kind: Literal["inference", "deployment", "job"]
    placed: bool
    assignments: tuple[Assignment, ...] = ()
    reason: Annotated[str, Field(max_length=2000)] | None = None
    policy: Annotated[str, Field(max_length=64)]
    mode: Mode
    epoch: Annotated[int, Field(ge=0)] = 0
    ts: Timestamp
    #: The deployment (replica) the assignments belong to: the one deployed, or the one an
    #: inference request was routed to.
    deployment_id: DeploymentId | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PlacementDecision:
        if self.placed and not self.assignments:
            raise ValueError("a placed decision needs at least one assignment")
        if not self.placed and not self.reason:
            raise ValueError("an unplaced decision needs a reason")
        return self
