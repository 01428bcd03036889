"""Work messages: placement requests and decisions, shard tasks, generation and token streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, model_validator

from libs.contracts.base import (
    DeploymentId,
    DeviceId,
    Endpoint,
    Fraction,
    Mode,
    ModelName,
    Precision,
    RequestId,
    Timestamp,
    WireModel,
)
from libs.contracts.models import ModelCard
from libs.contracts.prompts import FinishReason, Prompt, TokenLogprob, ToolCall

Count = Annotated[int, Field(ge=0, le=10_000_000)]
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
    memory_gb: Annotated[float, Field(ge=0.0)] = 0.0

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


class ShardTask(WireModel):
    """Tells a worker to load (or drop) one shard of a deployment. ``epoch`` grows on migration."""

    action: Literal["load", "unload"]
    deployment_id: DeploymentId
    model: ModelName
    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)]
    shard_count: Annotated[int, Field(ge=1)]
    layer_start: Annotated[int, Field(ge=0)]
    layer_end: Annotated[int, Field(ge=1)]
    next_device_id: DeviceId | None = None
    #: Every device of the pipeline in order: the last shard sends tokens back to the first.
    route: tuple[DeviceId, ...] = Field(default=(), max_length=256)
    epoch: Annotated[int, Field(ge=0)]
    ts: Timestamp
    #: The deployment's precision (None: the worker's own, ``TESSERA_WORKER_PRECISION``).
    precision: Precision | None = None
    #: Every shard's layers (start, end), in route order (an engine that runs the whole
    #: pipeline from its first shard, llama.cpp's, needs them all).
    spans: tuple[tuple[int, int], ...] = Field(default=(), max_length=256)
    #: Every device's llama.cpp RPC address (host:port), in route order; empty unless every
    #: device of the route announced one.
    endpoints: tuple[Endpoint, ...] = Field(default=(), max_length=256)
    #: The deployment's context length, tokens (None: the worker's own; llama.cpp's server
    #: gives each request slot this much KV cache, as the placement counted).
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    #: The model's card (its file, architecture and sizes), on a load: a worker serves a
    #: registered model from it (None: a task built outside a deployment, or an unload).
    card: ModelCard | None = None

    @model_validator(mode="after")
    def _shape(self) -> ShardTask:
        if self.layer_end <= self.layer_start:
            raise ValueError("layer_end must be above layer_start")
        if self.shard_index >= self.shard_count:
            raise ValueError("shard_index must be below shard_count")
        if self.route and (
            len(self.route) != self.shard_count or self.route[self.shard_index] != self.device_id
        ):
            raise ValueError("route must list shard_count devices with this one at shard_index")
        for name in ("spans", "endpoints"):
            if getattr(self, name) and len(getattr(self, name)) != self.shard_count:
                raise ValueError(f"{name} must list shard_count entries")
        if self.spans and self.spans[self.shard_index] != (self.layer_start, self.layer_end):
            raise ValueError("spans must hold this shard's layers at shard_index")
        return self


def shard_ring(
    action: Literal["load", "unload"],
    deployment_id: str,
    model: str,
    shards: Sequence[tuple[str, int, int]],
    epoch: int,
    ts: float,
    precision: Precision | None = None,
    endpoints: Sequence[str] = (),
    context_length: int | None = None,
    card: ModelCard | None = None,
) -> list[ShardTask]:
    """One task per shard of a pipeline: ``shards`` lists (device, layer_start, layer_end) in
    order; each shard learns the next device, the whole route (the last one sends tokens back
    to the first), every shard's layers and, where given, every device's RPC address."""
    route = tuple(device for device, _, _ in shards)
    spans = tuple((start, end) for _, start, end in shards)
    return [
        ShardTask(
            action=action,
            deployment_id=deployment_id,
            model=model,
            device_id=device,
            shard_index=i,
            shard_count=len(route),
            layer_start=start,
            layer_end=end,
            next_device_id=route[i + 1] if i + 1 < len(route) else None,
            route=route,
            epoch=epoch,
            ts=ts,
            precision=precision,
            spans=spans,
            endpoints=tuple(endpoints),
            context_length=context_length,
            card=card if action == "load" else None,
        )
        for i, (device, start, end) in enumerate(shards)
    ]


class Sampling(WireModel):
    max_tokens: Annotated[int, Field(ge=1, le=32_768)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=4
    )
    seed: Annotated[int, Field(ge=0)] | None = None


class GenerationRequest(WireModel):
    """A prompt sent to the first shard of a deployment; tokens come back on the token subject."""

    request_id: RequestId
    deployment_id: DeploymentId
    epoch: Annotated[int, Field(ge=0)]
    #: The prompt's tokens (empty only when ``prompt`` carries the request as text).
    prompt_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    #: Tokens already streamed to the user: a re-run after migration continues after them.
    generated_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    sampling: Sampling = Sampling()
    ts: Timestamp
    #: The request as OpenAI's fields, for an engine that applies the model's own template
    #: (llama.cpp's); an engine of token ids uses ``prompt_token_ids`` and refuses it when it
    #: names a field that engine cannot honour.
    prompt: Prompt | None = None
    #: Pieces of ``prompt``'s answer the user already has: a re-run after migration runs it
    #: again with the same seed and sends only the pieces after them.
    delivered: Count = 0

    @model_validator(mode="after")
    def _some_prompt(self) -> GenerationRequest:
        if not self.prompt_token_ids and self.prompt is None:
            raise ValueError("a request needs prompt_token_ids or a prompt")
        return self


class StepRow(WireModel):
    """One request's part of a batched step between shards (a ``STEP`` frame's meta).

    ``kind`` is a ``FrameKind``: PREFILL (``rows`` prompt states from ``position``; ``final``
    on the prompt's last chunk; ``request`` on its first), DECODE (the newest token's state),
    TOKEN (the last shard's sampled ``token``, back to the first) or END (``reason``)."""

    request_id: RequestId
    kind: Annotated[int, Field(ge=1, le=4)]
    position: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    rows: Annotated[int, Field(ge=0, le=4096)] = 0
    final: bool = False
    token: Annotated[int, Field(ge=0)] | None = None
    request: GenerationRequest | None = None
    reason: Annotated[str, Field(max_length=64)] | None = None


class TokenChunk(WireModel):
    """One streamed token (``index`` counts from 0 per request) or the final chunk; for a
    ``prompt`` request, one piece (text, whole tool calls) with ``token_id`` None."""

    request_id: RequestId
    index: Count
    token_id: Annotated[int, Field(ge=0)] | None = None
    text: Annotated[str, Field(max_length=4096)] = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: Annotated[str, Field(max_length=2000)] | None = None
    #: With ``finish_reason`` error: the request's field the engine cannot honour (the user
    #: gets 400 naming it), or ``request`` for a request the engine found invalid.
    invalid: Annotated[str, Field(pattern=r"^[a-z_.]{1,64}$")] | None = None
    #: Tool calls, each whole (a ``prompt`` request's answer).
    tool_calls: tuple[ToolCall, ...] = Field(default=(), max_length=64)
    #: The piece's tokens' log-probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = Field(default=(), max_length=4096)
    #: An embeddings request's piece: one input's vector.
    embedding: tuple[float, ...] = Field(default=(), max_length=65536)
    #: On the final chunk of a ``prompt`` request a stop sequence ended: which one.
    stop_sequence: Annotated[str, Field(max_length=256)] | None = None
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    device_id: DeviceId | None = None
    #: The placement epoch that produced it: after a re-run the owner keeps only the new one.
    epoch: Annotated[int, Field(ge=0)] = 0
    ts: Timestamp

    @classmethod
    def failure(
        cls, request_id: str, index: int, epoch: int, message: str, ts: float, **fields: object
    ) -> TokenChunk:
        """The final chunk of a request that could not go on."""
        return cls(
            request_id=request_id,
            index=index,
            finished=True,
            finish_reason="error",
            error=message[:2000],
            epoch=epoch,
            ts=ts,
            **fields,
        )


class GenerationCancel(WireModel):
    """Stop one request on every shard of a deployment (the user went away)."""

    request_id: RequestId
    reason: Annotated[str, Field(min_length=1, max_length=200)] = "cancelled"
    ts: Timestamp


ShardState = Literal["loading", "loaded", "refused", "unloaded", "failed"]


class ShardStatus(WireModel):
    """A worker's answer to a ``ShardTask``: the shard is loading (with ``progress``, sent as
    it goes), loaded, refused (it cannot serve it: ``reason`` says why, re-placing elsewhere
    may help), unloaded or failed (it tried and broke: ``reason``)."""

    deployment_id: DeploymentId
    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)]
    epoch: Annotated[int, Field(ge=0)]
    state: ShardState
    engine: Annotated[str, Field(max_length=32)] = "torch"
    reason: Annotated[str, Field(max_length=2000)] | None = None
    #: Share of the shard loaded so far (``loading``); 1.0 once ``loaded``.
    progress: Fraction | None = None
    load_s: Annotated[float, Field(ge=0.0)] = 0.0
    ts: Timestamp


class WeightsProgress(WireModel):
    """A device's share of a model's weights on its way to it (``WEIGHTS_PROGRESS``): bytes
    received of the bytes it needs (its whole file, or its layer range's chunks), sent as they
    arrive (every ~5 % or second) and once at the end. The dashboard draws it per device."""

    device_id: DeviceId
    model: ModelName
    deployment_id: DeploymentId
    shard_index: Annotated[int, Field(ge=0)]
    bytes_done: Annotated[int, Field(ge=0, le=1 << 50)]
    bytes_total: Annotated[int, Field(ge=0, le=1 << 50)]
    ts: Timestamp

    @model_validator(mode="after")
    def _within(self) -> WeightsProgress:
        if self.bytes_done > self.bytes_total:
            raise ValueError("bytes_done is more than bytes_total")
        return self
