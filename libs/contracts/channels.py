"""Every NATS subject Tessera uses, each bound to the one model it carries.

This is the only place subject strings are written. A ``Channel`` renders its subject from
validated tokens, gives the wildcard a consumer subscribes to, and encodes/decodes its model.
Subjects are versioned (``tessera.v1.…``); a breaking change to a model gets a new channel.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from libs.contracts.base import TOKEN_PATTERN
from libs.contracts.control import (
    DeviceRevocation,
    JoinAnswer,
    JoinRequest,
    ModeChange,
    RevocationAnswer,
    SchedulerCheckpoint,
    ServiceRestarted,
    TokenAnswer,
    TokenRotation,
)
from libs.contracts.deployments import DeploymentEvent, DeploymentMeasured, DeploymentsSnapshot
from libs.contracts.device import (
    AnnounceRequest,
    DeviceAnnounce,
    DeviceFailed,
    DeviceLeaving,
    DeviceRecovered,
    DvfsHint,
    ScoreUpdate,
    TelemetrySample,
)
from libs.contracts.errors import ContractError
from libs.contracts.generation import GenerationCancel, GenerationRequest, TokenChunk
from libs.contracts.models import WeightsWant
from libs.contracts.placement import PlacementDecision, PlacementRequest
from libs.contracts.shards import ShardStatus, ShardTask, WeightsProgress

M = TypeVar("M", bound=BaseModel)

#: Largest message any consumer accepts (bytes); nats-server's default max payload is 1 MiB.
MAX_MESSAGE_BYTES = 1024 * 1024

_TOKEN = re.compile(TOKEN_PATTERN)


@dataclass(frozen=True)
class Subject:
    """A subject template; each ``{name}`` field is one token."""

    name: str
    template: str

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)

    def subject(self, **tokens: str) -> str:
        """The concrete subject. Raises ``ContractError`` on a missing or unsafe token."""
        if set(tokens) != set(self.params):
            raise ContractError("bad_subject", f"{self.name} needs tokens {self.params}")
        for key, value in tokens.items():
            if not _TOKEN.match(value):
                raise ContractError("bad_subject", f"{key}={value!r} is not a subject token")
        return self.template.format(**tokens)

    def pattern(self, **fixed: str) -> str:
        """The subject with the given fields set and every other field ``*``."""
        tokens = {p: "*" for p in self.params}
        tokens.update({k: self.subject_token(k, v) for k, v in fixed.items()})
        return self.template.format(**tokens)

    def subject_token(self, key: str, value: str) -> str:
        if key not in self.params or not _TOKEN.match(value):
            raise ContractError("bad_subject", f"{key}={value!r} is not a {self.name} token")
        return value

    @property
    def wildcard(self) -> str:
        """The subject with each ``{name}`` field set to ``*``: what a consumer subscribes to."""
        return self.template.format(**{p: "*" for p in self.params})

    def token_of(self, subject: str, param: str) -> str:
        """Read one field's value back out of a concrete subject."""
        parts = self.template.split(".")
        index = parts.index("{" + param + "}")
        return subject.split(".")[index]


@dataclass(frozen=True)
class Channel(Subject, Generic[M]):
    """A subject and the model it carries."""

    model: type[M]
    #: JetStream stream that persists this channel, if any.
    stream: str | None = None

    def encode(self, message: M) -> bytes:
        if not isinstance(message, self.model):
            raise TypeError(f"{self.name} carries {self.model.__name__}, got {type(message)}")
        return message.model_dump_json(exclude_defaults=False).encode()

    def decode(self, data: bytes) -> M:
        """Parse and validate. Raises ``ContractError`` whose detail names the failing fields."""
        if len(data) > MAX_MESSAGE_BYTES:
            raise ContractError("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
        try:
            return self.model.model_validate_json(data)
        except ValidationError as exc:
            raise ContractError(_reason(exc), _describe(exc)) from None


def _reason(exc: ValidationError) -> str:
    kinds = {e["type"] for e in exc.errors()}
    if "json_invalid" in kinds or "json_type" in kinds:
        return "malformed_json"
    if kinds & {"extra_forbidden", "missing"}:
        return "wrong_fields"
    if any(k.endswith("_type") or k.endswith("_parsing") for k in kinds):
        return "wrong_type"
    return "out_of_range"


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "<message>"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


ANNOUNCE = Channel("announce", "tessera.v1.device.announce.{device_id}", DeviceAnnounce)
ANNOUNCE_REQUEST = Channel(
    "announce_request", "tessera.v1.device.announce_request", AnnounceRequest
)
TELEMETRY = Channel("telemetry", "tessera.v1.telemetry.{device_id}", TelemetrySample)
SCORE = Channel("score", "tessera.v1.score.{device_id}", ScoreUpdate)
DEVICE_FAILED = Channel("device_failed", "tessera.v1.device.failed.{device_id}", DeviceFailed)
DEVICE_LEAVING = Channel("device_leaving", "tessera.v1.device.leaving.{device_id}", DeviceLeaving)
DEVICE_RECOVERED = Channel(
    "device_recovered", "tessera.v1.device.recovered.{device_id}", DeviceRecovered
)
DVFS_HINT = Channel("dvfs_hint", "tessera.v1.hint.dvfs.{device_id}", DvfsHint)
PLACEMENT_REQUEST = Channel("placement_request", "tessera.v1.placement.request", PlacementRequest)
PLACEMENT_DECISION = Channel(
    "placement_decision", "tessera.v1.placement.decision.{task_id}", PlacementDecision
)
SHARD_TASK = Channel("shard_task", "tessera.v1.work.{device_id}", ShardTask, stream="TESSERA_WORK")
GENERATION = Channel(
    "generation", "tessera.v1.generate.{deployment_id}.{device_id}", GenerationRequest
)
#: A request's token chunks, from the device that sent them: the gateway takes a chunk only
#: from a device of the request's route, and a device's NATS user may publish only its own.
TOKENS = Channel("tokens", "tessera.v1.tokens.{request_id}.{device_id}", TokenChunk)
CANCEL = Channel("cancel", "tessera.v1.cancel.{deployment_id}", GenerationCancel)
SHARD_STATUS = Channel("shard_status", "tessera.v1.shard.status.{device_id}", ShardStatus)
#: Each change the scheduler makes to what is deployed, numbered (libs/deployments folds them).
DEPLOYMENT_EVENT = Channel(
    "deployment_event", "tessera.v1.deployment.event.{deployment_id}", DeploymentEvent
)
#: Every deployment at once: by the scheduler when it starts leading, and every 15 s, so a
#: follower that missed an event catches up.
DEPLOYMENTS_SNAPSHOT = Channel(
    "deployments_snapshot", "tessera.v1.deployment.snapshot", DeploymentsSnapshot
)
#: What a deployment's requests measured, by the gateway to the scheduler (each deployment
#: at most every few seconds).
DEPLOYMENT_MEASURED = Channel(
    "deployment_measured", "tessera.v1.deployment.measured.{deployment_id}", DeploymentMeasured
)
#: Hidden states between shards: binary ``Frame``s (libs/contracts/frames.py), not a model.
#: ``device_id`` receives, ``sender_id`` sent: a device's NATS user may publish only frames that
#: name itself as the sender, and a worker takes them only from a device of the deployment.
HIDDEN = Subject("hidden", "tessera.v1.hidden.{deployment_id}.{device_id}.{sender_id}")
#: Bytes a device sends to measure its bandwidth to NATS (``libs/agents/link_probe.py``):
#: nobody subscribes; only the device may publish on its own.
PROBE = Subject("probe", "tessera.v1.probe.{device_id}")
MODE_CHANGE = Channel("mode_change", "tessera.v1.scheduler.mode", ModeChange)
#: A host joins (``tessera join``): asked as the ``join`` user, answered by ``tessera up``.
JOIN = Channel("join", "tessera.v1.cluster.join", JoinRequest)
JOIN_ANSWER = Channel("join_answer", "tessera.v1.cluster.join.answer", JoinAnswer)
#: ``tessera token rotate``: asked as the admin, answered with the new token.
TOKEN_ROTATE = Channel("token_rotate", "tessera.v1.cluster.token.rotate", TokenRotation)
TOKEN_ANSWER = Channel("token_answer", "tessera.v1.cluster.token.answer", TokenAnswer)
#: ``tessera devices revoke``: asked as the admin (no other user may), answered by ``tessera up``.
DEVICE_REVOKE = Channel("device_revoke", "tessera.v1.cluster.device.revoke", DeviceRevocation)
REVOKE_ANSWER = Channel("revoke_answer", "tessera.v1.cluster.device.revoked", RevocationAnswer)
#: A device's weights as they arrive (``WeightsProgress``): the gateway's event feed shows it.
WEIGHTS_PROGRESS = Channel(
    "weights_progress", "tessera.v1.weights.progress.{device_id}", WeightsProgress
)
#: A device asks the holders of a model's file to lend it (``WeightsWant``); each holder
#: answers on the reply subject (``WeightsOffer``: its lender's address and a one-use ticket).
WEIGHTS_WANT = Channel("weights_want", "tessera.v1.weights.want.{device_id}", WeightsWant)
#: ``tessera up`` restarted one of its services, or gave up on it (``ServiceRestarted``).
SERVICE_RESTART = Channel(
    "service_restart", "tessera.v1.cluster.service.{service}", ServiceRestarted
)
CHECKPOINT = Channel(
    "checkpoint", "tessera.v1.scheduler.checkpoint", SchedulerCheckpoint, stream="TESSERA_STATE"
)

ALL_CHANNELS: tuple[Channel[BaseModel], ...] = (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    TELEMETRY,
    SCORE,
    DEVICE_FAILED,
    DEVICE_LEAVING,
    DEVICE_RECOVERED,
    DVFS_HINT,
    PLACEMENT_REQUEST,
    PLACEMENT_DECISION,
    SHARD_TASK,
    GENERATION,
    TOKENS,
    CANCEL,
    SHARD_STATUS,
    DEPLOYMENT_EVENT,
    DEPLOYMENTS_SNAPSHOT,
    DEPLOYMENT_MEASURED,
    WEIGHTS_PROGRESS,
    WEIGHTS_WANT,
    MODE_CHANGE,
    CHECKPOINT,
    JOIN,
    JOIN_ANSWER,
    TOKEN_ROTATE,
    TOKEN_ANSWER,
    DEVICE_REVOKE,
    REVOKE_ANSWER,
    SERVICE_RESTART,
)  # type: ignore[assignment]


def work_consumer(device_id: str) -> str:
    """The durable consumer through which ``device_id``'s worker takes its shard tasks: the
    only consumer its NATS user may create, read or acknowledge on (libs/cluster/access.py)."""
    return f"worker-{device_id}"


#: The object store of model weights (another stream: ``OBJ_<bucket>``): devices only read it.
MODEL_BUCKET = "TESSERA_MODELS"

#: JetStream streams and the subjects each persists.
STREAMS: dict[str, tuple[str, ...]] = {
    "TESSERA_WORK": (SHARD_TASK.wildcard,),
    "TESSERA_STATE": (CHECKPOINT.wildcard,),
}
