"""Deployments on the wire: a deployment's state, the indexed events that change it, and the
whole set as one snapshot.

The scheduler is the one writer. Every change it makes to what is deployed is an event,
numbered in order (``DeploymentEvent.index``) within the scheduler's leadership
(``DeploymentEvent.term``), published on ``DEPLOYMENT_EVENT``; the state is what those events
fold to (``libs/deployments``). A follower (the gateway, the dashboard, ``tessera``) applies
them in order and asks for the whole set (``DeploymentsSnapshot``) when it starts, when an
index is missing, or when a new leader's term begins.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from libs.contracts.base import (
    DEFAULT_CONTEXT_TOKENS,
    DeploymentId,
    DeviceId,
    ModelName,
    Precision,
    Timestamp,
    WireModel,
)
from libs.contracts.placement import Assignment
from libs.contracts.shards import ShardState

#: Where a deployment stands, driven by what its workers report: ``pending`` (tasks sent, no
#: worker has answered), ``loading`` (some shards loading or loaded), ``serving`` (every shard
#: of the current epoch loaded: requests are routed to it only now), ``refused`` (no placement
#: is left without the devices that refused), ``failed`` (a worker failed and no placement is
#: left). ``refused`` and ``failed`` are final until the user deploys again. ``removed``: the
#: user undeployed it (a status shown once; the state holds it no more).
DeploymentPhase = Literal["pending", "loading", "serving", "refused", "failed", "removed"]


class ShardProgress(WireModel):
    """One shard of a deployment as its worker last reported it."""

    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)]
    state: Literal["pending"] | ShardState
    progress: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    reason: Annotated[str, Field(max_length=2000)] | None = None


class Speed(WireModel):
    """A deployment's speed, predicted when it is placed or measured while it serves:
    aggregate tokens/s with 1 and with 8 requests at once, and the time to a first token."""

    tokens_per_s_1: Annotated[float, Field(ge=0.0, le=10_000_000.0)]
    #: None: not measured yet (no 8 requests ran at once).
    tokens_per_s_8: Annotated[float, Field(ge=0.0, le=10_000_000.0)] | None = None
    #: Predicted: for a prompt of 64 tokens; measured: the median of requests that ran alone.
    ttft_ms: Annotated[float, Field(ge=0.0, le=86_400_000.0)] | None = None
    #: Predicted only: the devices' draw (W) at 1 and 8 streams, from the draws they report.
    watts_1: Annotated[float, Field(ge=0.0, le=10_000_000.0)] | None = None
    watts_8: Annotated[float, Field(ge=0.0, le=10_000_000.0)] | None = None


class DeploymentState(WireModel):
    """One deployment (or one replica of it) as the scheduler holds it."""

    deployment_id: DeploymentId
    model: ModelName
    epoch: Annotated[int, Field(ge=0)]
    context_length: Annotated[int, Field(ge=1)]
    assignments: tuple[Assignment, ...]
    #: The deployment this one is a replica of (None: the first, or the only one).
    replica_of: DeploymentId | None = None
    #: Its weights' precision on the CPU shard engine (None: the model's default).
    precision: Precision | None = None
    #: Where it stands, as its workers report (``DeploymentPhase``); a checkpoint written
    #: before phases existed held only deployments that served.
    phase: DeploymentPhase = "serving"
    #: Why it is refused or failed, or why it was last re-planned.
    reason: Annotated[str, Field(max_length=2000)] | None = None
    #: The current epoch's shards as their workers last reported them.
    shards: tuple[ShardProgress, ...] = Field(default=(), max_length=1024)
    #: Devices whose workers refused or failed it: its re-plans leave them out.
    refused_by: tuple[DeviceId, ...] = Field(default=(), max_length=1024)
    #: The most devices one copy may be split over (the deploy's ``max_shards``).
    max_shards: Annotated[int, Field(ge=1, le=256)] = 8
    #: What the deploy told, kept by its re-plans: the shard count and the devices (empty:
    #: the scheduler's choice).
    shard_count: Annotated[int, Field(ge=1, le=256)] | None = None
    devices: tuple[DeviceId, ...] = Field(default=(), max_length=256)
    #: The current plan's speed as predicted when it was made (``libs/core/predict.py``;
    #: None: its engine has no fitted model), and as its requests measured it since.
    predicted: Speed | None = None
    measured: Speed | None = None

    @property
    def base(self) -> str:
        """The deployment this copy belongs to: its own id, or the one it is a replica of."""
        return self.replica_of or self.deployment_id

    @property
    def route(self) -> tuple[str, ...]:
        """Its devices in pipeline order (first shard first)."""
        ordered = sorted(self.assignments, key=lambda a: a.shard_index)
        return tuple(a.device_id for a in ordered)


class DeploymentStatus(WireModel):
    """A deployment as its users see it (the scheduler's ``GET /placements/{deployment_id}``,
    ``tessera deploy``, the dashboard): its phase and the progress of its current plan."""

    deployment_id: DeploymentId
    model: ModelName
    phase: DeploymentPhase
    epoch: Annotated[int, Field(ge=0)] = 0
    #: Share of the current placement's shards loaded (loading progress included).
    progress: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    #: Why it is refused or failed, or why it was last re-planned.
    reason: Annotated[str, Field(max_length=2000)] | None = None
    shards: tuple[ShardProgress, ...] = Field(default=(), max_length=1024)
    #: The deployment this one is a replica of (None: the first, or the only one).
    replica_of: DeploymentId | None = None
    #: Tokens of context each request may use (prompt and completion).
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] = DEFAULT_CONTEXT_TOKENS
    ts: Timestamp


# -- the events -------------------------------------------------------------------------------


class DeploymentPlanned(WireModel):
    """A plan sent to workers: a new deployment, a replica, or a deployment re-planned under a
    new epoch (its shards pending until their workers report)."""

    kind: Literal["planned"] = "planned"
    deployment: DeploymentState


class ShardReported(WireModel):
    """A worker's report on one shard of a deployment's current epoch."""

    kind: Literal["shard"] = "shard"
    deployment_id: DeploymentId
    epoch: Annotated[int, Field(ge=0)]
    shard: ShardProgress


class DeploymentStopped(WireModel):
    """No placement is left: the deployment ends ``refused`` or ``failed`` with the reason,
    remembering the devices its later deploys leave out."""

    kind: Literal["stopped"] = "stopped"
    deployment_id: DeploymentId
    phase: Literal["refused", "failed"]
    reason: Annotated[str, Field(min_length=1, max_length=2000)]
    refused_by: tuple[DeviceId, ...] = Field(default=(), max_length=1024)


class DeploymentRemoved(WireModel):
    """The user undeployed it, or deployed it again after it stopped: it is no more."""

    kind: Literal["removed"] = "removed"
    deployment_id: DeploymentId


class DeploymentMeasured(WireModel):
    """What a deployment's requests measured (the gateway times every one): sent to the
    scheduler, which records it beside the prediction and corrects its model by it."""

    kind: Literal["measured"] = "measured"
    deployment_id: DeploymentId
    epoch: Annotated[int, Field(ge=0)]
    measured: Speed
    #: How many requests it is measured from.
    requests: Annotated[int, Field(ge=1)]


DeploymentChange = Annotated[
    DeploymentPlanned | ShardReported | DeploymentStopped | DeploymentRemoved | DeploymentMeasured,
    Field(discriminator="kind"),
]

#: A leadership of the scheduler: a new leader draws a new one, so followers know its indices
#: start from its own checkpoint and not from where the last leader stopped.
Term = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class DeploymentEvent(WireModel):
    """One change, numbered: ``index`` is one more than the event before it in ``term``."""

    term: Term
    index: Annotated[int, Field(ge=1)]
    ts: Timestamp
    change: DeploymentChange


class DeploymentsSnapshot(WireModel):
    """Every deployment as the events up to ``index`` of ``term`` left them."""

    term: Term
    index: Annotated[int, Field(ge=0)]
    ts: Timestamp
    deployments: tuple[DeploymentState, ...] = Field(default=(), max_length=4096)
