"""Control-plane messages: mode changes and the scheduler's checkpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from libs.contracts.base import DeviceId, Mode, Timestamp, WireModel
from libs.contracts.deployments import DeploymentState
from libs.contracts.placement import PlacementDecision, PlacementRequest
from libs.contracts.profiles import DimensionWeights

CHECKPOINT_SCHEMA_VERSION = 1  # the Literal on SchedulerCheckpoint.schema_version


class ModeChange(WireModel):
    """The scheduling mode or the active profile changed. ``weights``: the dimension weights
    the scorer must score with (the active profile's); absent, the mode's built-in ones."""

    mode: Mode
    previous: Mode
    manual: bool
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    ts: Timestamp
    weights: DimensionWeights | None = None


class SchedulerCheckpoint(WireModel):
    """Everything the scheduler needs to resume after a restart."""

    schema_version: Literal[1] = 1
    ts: Timestamp
    mode: Mode
    policy: str
    weights: dict[str, Annotated[float, Field(ge=0.0, le=100.0)]]
    #: The deployments as the events up to ``deployment_index`` left them (libs/deployments).
    deployments: tuple[DeploymentState, ...] = ()
    deployment_index: Annotated[int, Field(ge=0)] = 0
    placements: tuple[PlacementDecision, ...] = ()
    queue: tuple[PlacementRequest, ...] = ()
    counters: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    #: The prediction's corrections, as the deployments' measurements left them
    #: (``libs/core/predict.py: corrected``; ``MODEL@DEVICE``, ``DEVICE``, ``MODEL@*``, ``*``).
    factors: dict[
        Annotated[str, Field(max_length=300)], Annotated[float, Field(gt=0.0, le=1e6)]
    ] = Field(default_factory=dict, max_length=100_000)


class JoinRequest(WireModel):
    """A host asks to join the cluster. It speaks as the ``join`` user, whose password is the
    cluster's token; what it gets back is a user of its own device, never more. The device
    draws that user's password itself and sends it here: only the join desk may read this
    subject, while every holder of the token reads every join answer (its inbox is theirs)."""

    device_id: DeviceId
    hostname: Annotated[str, Field(min_length=1, max_length=255)]
    ts: Timestamp
    #: The password the device's NATS user gets (URL-safe: it goes into a nats:// URL).
    password: Annotated[str, Field(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
    #: A certificate signing request (PEM) for a key made on the joining host: the cluster's
    #: CA signs a certificate naming the device for llama.cpp's RPC channel (libs/runtime/pki.py).
    csr_pem: Annotated[str, Field(max_length=4096)] = ""


class JoinAnswer(WireModel):
    """The joining device's NATS user (with the password its request gave), or why it was
    refused; with the certificate its request asked for and the cluster CA's. Nothing in it
    is secret: any holder of the join token may read it."""

    device_id: DeviceId
    user: Annotated[str, Field(max_length=128)] = ""
    refused: Annotated[str, Field(max_length=500)] = ""
    certificate_pem: Annotated[str, Field(max_length=4096)] = ""
    ca_pem: Annotated[str, Field(max_length=4096)] = ""


class TokenRotation(WireModel):
    """The admin asks for a new join token: the old one stops working at once (devices that
    joined with it keep their own users)."""

    ts: Timestamp


class TokenAnswer(WireModel):
    token: Annotated[str, Field(min_length=16, max_length=128)]


class DeviceRevocation(WireModel):
    """The admin removes one device's NATS user (``tessera devices revoke``): its connection
    is closed at once and its shards move."""

    device_id: DeviceId
    ts: Timestamp


class RevocationAnswer(WireModel):
    device_id: DeviceId
    #: Why it was not revoked ("" when it was).
    refused: Annotated[str, Field(max_length=500)] = ""


class ServiceRestarted(WireModel):
    """``tessera up`` started one of its services again after it exited (``state``
    ``running``), or gave up on one that kept crashing (``failed``): the dashboard's feed
    shows it, the gateway counts it (``tessera_cluster_service_restarts_total``)."""

    #: The service's name in ``tessera up`` (``scheduler``, ``worker-1``, …).
    service: DeviceId
    #: How it ended (``stopped by SIGKILL``, ``exited with code 1``).
    how: Annotated[str, Field(max_length=200)]
    #: Restarts since the cluster started.
    restarts: Annotated[int, Field(ge=0)]
    state: Literal["running", "failed"]
    ts: Timestamp
