"""Builders of valid messages, with overrides: ``make_telemetry(temperature_c=90)``."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    CANCEL,
    CHECKPOINT,
    DEPLOYMENT_EVENT,
    DEPLOYMENT_MEASURED,
    DEPLOYMENTS_SNAPSHOT,
    DEVICE_FAILED,
    DEVICE_LEAVING,
    DEVICE_RECOVERED,
    DVFS_HINT,
    GENERATION,
    JOIN,
    JOIN_ANSWER,
    MODE_CHANGE,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SCORE,
    SHARD_STATUS,
    SHARD_TASK,
    TELEMETRY,
    TOKEN_ANSWER,
    TOKEN_ROTATE,
    TOKENS,
    WEIGHTS_PROGRESS,
    WEIGHTS_WANT,
    AnnounceRequest,
    Assignment,
    BatchJob,
    Capabilities,
    Channel,
    DeploymentEvent,
    DeploymentMeasured,
    DeploymentsSnapshot,
    DeploymentState,
    DeviceAnnounce,
    DeviceClass,
    DeviceFailed,
    DeviceLeaving,
    DeviceRecovered,
    DvfsHint,
    GenerationCancel,
    GenerationRequest,
    InferenceRequest,
    JoinAnswer,
    JoinRequest,
    MemoryType,
    Mode,
    ModeChange,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    SchedulerCheckpoint,
    ScoreUpdate,
    ShardProgress,
    ShardReported,
    ShardStatus,
    ShardTask,
    Speed,
    TelemetrySample,
    TokenAnswer,
    TokenChunk,
    TokenRotation,
    WeightsProgress,
    WeightsWant,
)
from libs.contracts.channels import DEVICE_REVOKE, REVOKE_ANSWER, SERVICE_RESTART
from libs.contracts.control import DeviceRevocation, RevocationAnswer, ServiceRestarted
from libs.core.model import Device, Task

NOW = 1_700_000_000.0


def make_capabilities(**over: Any) -> Capabilities:
    fields: dict[str, Any] = dict(
        fp32_tflops=2.0,
        int8_tops=8.0,
        memory_bandwidth_gbps=60.0,
        memory_total_gb=8.0,
        memory_type=MemoryType.LPDDR5,
        typical_power_w=8.0,
        max_power_w=12.0,
        thermal_limit_c=85.0,
        delta_t_c=20.0,
        has_battery=True,
        network_bandwidth_mbps=200.0,
    )
    return Capabilities(**{**fields, **over})


def make_telemetry(device_id: str = "dev-1", **over: Any) -> TelemetrySample:
    fields: dict[str, Any] = dict(
        device_id=device_id,
        seq=1,
        ts=NOW,
        cpu_utilisation=0.25,
        memory_total_gb=8.0,
        memory_available_gb=4.0,
        power_w=5.0,
        temperature_c=40.0,
        battery_percent=80.0,
        plugged=False,
        network_rtt_ms=12.0,
        network_bandwidth_mbps=200.0,
    )
    return TelemetrySample(**{**fields, **over})


def make_inference(request_id: str = "req-1", **over: Any) -> InferenceRequest:
    fields: dict[str, Any] = dict(
        request_id=request_id, model="smollm2-135m-instruct", prompt_tokens=20, max_tokens=16
    )
    return InferenceRequest(**{**fields, **over})


def make_decision(task_id: str = "req-1", **over: Any) -> PlacementDecision:
    fields: dict[str, Any] = dict(
        task_id=task_id,
        kind="deployment",
        placed=True,
        assignments=(
            Assignment(
                device_id="dev-1", shard_index=0, layer_start=0, layer_end=15, memory_gb=0.1
            ),
            Assignment(
                device_id="dev-2", shard_index=1, layer_start=15, layer_end=30, memory_gb=0.1
            ),
        ),
        policy="dwps",
        mode=Mode.BALANCED,
        ts=NOW,
    )
    return PlacementDecision(**{**fields, **over})


def sample_messages(
    device_id: str = "dev-1", request_id: str = "req-1"
) -> list[tuple[Channel[BaseModel], BaseModel, dict[str, str]]]:
    """One valid message per channel, with the subject tokens it is published under."""
    dev = {"device_id": device_id}
    samples: list[tuple[Channel[Any], BaseModel, dict[str, str]]] = [
        (
            ANNOUNCE,
            DeviceAnnounce(
                device_id=device_id,
                device_class=DeviceClass.PHONE,
                capabilities=make_capabilities(),
                emulated=True,
                ts=NOW,
            ),
            dev,
        ),
        (ANNOUNCE_REQUEST, AnnounceRequest(reason="scorer started", ts=NOW), {}),
        (TELEMETRY, make_telemetry(device_id), dev),
        (
            SCORE,
            ScoreUpdate(
                device_id=device_id,
                device_class=DeviceClass.LAPTOP,
                ts=NOW,
                mode=Mode.BALANCED,
                compute=0.4,
                memory=0.5,
                efficiency=0.6,
                network=0.7,
                stability=0.99,
                total=0.55,
                sample=make_telemetry(device_id),
                speed_scale=0.5,
                announced_ts=NOW,
            ),
            dev,
        ),
        (
            DEVICE_FAILED,
            DeviceFailed(device_id=device_id, ts=NOW, last_seen_ts=NOW - 15, missed_heartbeats=3),
            dev,
        ),
        (DEVICE_RECOVERED, DeviceRecovered(device_id=device_id, ts=NOW, down_for_s=20.0), dev),
        (
            DVFS_HINT,
            DvfsHint(device_id=device_id, ts=NOW, frequency_scale=0.6, reason="light load"),
            dev,
        ),
        (PLACEMENT_REQUEST, PlacementRequest(task=make_inference(request_id), ts=NOW), {}),
        (
            PLACEMENT_REQUEST,
            PlacementRequest(
                task=ModelDeployment(deployment_id="dep-1", model="smollm2-135m-instruct"), ts=NOW
            ),
            {},
        ),
        (
            PLACEMENT_REQUEST,
            PlacementRequest(
                task=BatchJob(
                    job_id="job-1",
                    task_name="tessera.train",
                    work_gflop=5.0,
                    memory_gb=1.0,
                    args={"iterations": 10},
                ),
                ts=NOW,
            ),
            {},
        ),
        (PLACEMENT_DECISION, make_decision(request_id), {"task_id": request_id}),
        (
            SHARD_TASK,
            ShardTask(
                action="load",
                deployment_id="dep-1",
                model="smollm2-135m-instruct",
                device_id=device_id,
                shard_index=0,
                shard_count=2,
                layer_start=0,
                layer_end=15,
                next_device_id="dev-2",
                epoch=1,
                ts=NOW,
            ),
            dev,
        ),
        (
            GENERATION,
            GenerationRequest(
                request_id=request_id,
                deployment_id="dep-1",
                epoch=1,
                prompt_token_ids=(1, 2, 3),
                ts=NOW,
            ),
            {"deployment_id": "dep-1", "device_id": device_id},
        ),
        (
            TOKENS,
            TokenChunk(request_id=request_id, index=0, token_id=42, text="Hi", ts=NOW),
            {"request_id": request_id, "device_id": device_id},
        ),
        (
            CANCEL,
            GenerationCancel(request_id=request_id, ts=NOW),
            {"deployment_id": "dep-1"},
        ),
        (
            SHARD_STATUS,
            ShardStatus(
                deployment_id="dep-1",
                device_id=device_id,
                shard_index=0,
                epoch=1,
                state="loaded",
                load_s=0.8,
                ts=NOW,
            ),
            {"device_id": device_id},
        ),
        (
            DEPLOYMENT_EVENT,
            DeploymentEvent(
                term="t1",
                index=2,
                ts=NOW,
                change=ShardReported(
                    deployment_id="dep-1",
                    epoch=1,
                    shard=ShardProgress(
                        device_id=device_id, shard_index=0, state="loading", progress=0.5
                    ),
                ),
            ),
            {"deployment_id": "dep-1"},
        ),
        (
            DEPLOYMENT_MEASURED,
            DeploymentMeasured(
                deployment_id="dep-1",
                epoch=1,
                measured=Speed(tokens_per_s_1=31.5, ttft_ms=120.0),
                requests=4,
            ),
            {"deployment_id": "dep-1"},
        ),
        (
            DEPLOYMENTS_SNAPSHOT,
            DeploymentsSnapshot(
                term="t1",
                index=1,
                ts=NOW,
                deployments=(
                    DeploymentState(
                        deployment_id="dep-1",
                        model="smollm2-135m-instruct",
                        epoch=1,
                        context_length=2048,
                        assignments=(Assignment(device_id=device_id, layer_end=30),),
                        phase="pending",
                        shards=(
                            ShardProgress(device_id=device_id, shard_index=0, state="pending"),
                        ),
                    ),
                ),
            ),
            {},
        ),
        (
            MODE_CHANGE,
            ModeChange(
                mode=Mode.ENERGY,
                previous=Mode.BALANCED,
                manual=False,
                reason="efficiency dropped 16 %",
                ts=NOW,
            ),
            {},
        ),
        (
            CHECKPOINT,
            SchedulerCheckpoint(
                ts=NOW,
                mode=Mode.BALANCED,
                policy="dwps",
                weights={"w1": 0.3},
                deployments=(
                    DeploymentState(
                        deployment_id="dep-1",
                        model="smollm2-135m-instruct",
                        epoch=1,
                        context_length=2048,
                        assignments=make_decision().assignments,
                    ),
                ),
                placements=(make_decision(),),
                counters={"migrations": 2},
            ),
            {},
        ),
        (
            DEVICE_LEAVING,
            DeviceLeaving(device_id=device_id, ts=NOW, reason="Ctrl-C on tessera join"),
            dev,
        ),
        (
            JOIN,
            JoinRequest(device_id=device_id, hostname="laptop.local", ts=NOW, password="pw" * 12),
            {},
        ),
        (JOIN_ANSWER, JoinAnswer(device_id=device_id, user=device_id), {}),
        (TOKEN_ROTATE, TokenRotation(ts=NOW), {}),
        (TOKEN_ANSWER, TokenAnswer(token="t" * 24), {}),
        (DEVICE_REVOKE, DeviceRevocation(device_id=device_id, ts=NOW), {}),
        (REVOKE_ANSWER, RevocationAnswer(device_id=device_id), {}),
        (
            SERVICE_RESTART,
            ServiceRestarted(
                service="scorer", how="stopped by SIGKILL", restarts=1, state="running", ts=NOW
            ),
            {"service": "scorer"},
        ),
        (
            WEIGHTS_PROGRESS,
            WeightsProgress(
                device_id=device_id,
                model="smollm2-135m-instruct",
                deployment_id="dep-1",
                shard_index=0,
                bytes_done=512,
                bytes_total=1024,
                ts=NOW,
            ),
            dev,
        ),
        (WEIGHTS_WANT, WeightsWant(device_id=device_id, sha256="ab" * 32, size_bytes=1024), dev),
    ]
    return samples  # type: ignore[return-value]


# -- the scheduling core --------------------------------------------------------------------

CLASS_DEFAULTS: dict[DeviceClass, dict[str, Any]] = {
    DeviceClass.WATCH: dict(
        capability=(0.1, 0.2, 0.7, 0.3, 0.9),
        memory_total_gb=2.0,
        power_max_w=2.0,
        power_idle_w=0.3,
        thermal_limit_c=85.0,
        delta_t_c=8.0,
        speed=0.5,
        battery_percent=80.0,
        plugged=False,
    ),
    DeviceClass.PHONE: dict(
        capability=(0.4, 0.5, 0.8, 0.5, 0.9),
        memory_total_gb=8.0,
        power_max_w=12.0,
        power_idle_w=1.0,
        thermal_limit_c=85.0,
        delta_t_c=15.0,
        speed=4.0,
        battery_percent=80.0,
        plugged=False,
    ),
    DeviceClass.LAPTOP: dict(
        capability=(0.6, 0.7, 0.6, 0.7, 0.9),
        memory_total_gb=16.0,
        power_max_w=45.0,
        power_idle_w=5.0,
        thermal_limit_c=85.0,
        delta_t_c=20.0,
        speed=10.0,
        battery_percent=90.0,
        plugged=True,
    ),
    DeviceClass.WORKSTATION: dict(
        capability=(0.9, 0.9, 0.3, 0.9, 0.95),
        memory_total_gb=64.0,
        power_max_w=300.0,
        power_idle_w=40.0,
        thermal_limit_c=95.0,
        delta_t_c=25.0,
        speed=40.0,
    ),
}


def make_device(
    device_id: str = "dev", device_class: DeviceClass = DeviceClass.LAPTOP, **over: Any
) -> Device:
    """A device of the class's typical figures, mostly idle; override any field."""
    fields: dict[str, Any] = dict(CLASS_DEFAULTS[device_class])
    fields.update(
        memory_free_gb=fields["memory_total_gb"] * 0.75,
        power_now_w=fields["power_idle_w"],
        temperature_c=35.0,
    )
    fields.update(over)
    return Device(device_id=device_id, device_class=device_class, **fields)


def make_task(task_id: str = "task", **over: Any) -> Task:
    fields: dict[str, Any] = dict(memory_gb=0.5, intensity=0.2, work=1.0)
    fields.update(over)
    return Task(task_id=task_id, **fields)


def mixed_fleet() -> list[Device]:
    return [
        make_device("watch", DeviceClass.WATCH),
        make_device("phone", DeviceClass.PHONE),
        make_device("laptop", DeviceClass.LAPTOP),
        make_device("workstation", DeviceClass.WORKSTATION),
    ]


def unload_task(device_id: str) -> ShardTask:
    """A one-shard task that unloads ``dep-1`` from ``device_id`` (a message for tests of
    who may publish and read shard tasks; no worker acts on it)."""
    return ShardTask(
        action="unload",
        deployment_id="dep-1",
        model="smollm2-135m-instruct",
        device_id=device_id,
        shard_index=0,
        shard_count=1,
        layer_start=0,
        layer_end=1,
        route=(device_id,),
        epoch=1,
        ts=time.time(),
    )
