"""Wire requests → core tasks, and core results → wire decisions. Pure."""

from __future__ import annotations

from libs.contracts import (
    Assignment,
    BatchJob,
    InferenceRequest,
    Mode,
    PlacementDecision,
    PlacementRequest,
)
from libs.core.catalogue import ModelSpec
from libs.core.model import Placement, Task, TaskKind
from libs.core.partition import Preview

#: Demand of an inference request when it states none: compute and memory heavy.
INFERENCE_DEMAND = (0.6, 0.4, 0.3, 0.3, 0.3)
JOB_DEMAND = (0.8, 0.5, 0.2, 0.1, 0.4)
SECONDS_PER_TOKEN = 0.03  # rough decode time used to expire a request's load
#: Share of a device's compute one more request keeps busy: serving devices batch requests.
INFERENCE_INTENSITY = 0.02


def to_task(request: PlacementRequest, spec: ModelSpec | None = None) -> Task:
    """``spec``: the requested model's sizes, where it is registered (its memory is counted)."""
    task = request.task
    if isinstance(task, InferenceRequest):
        context = task.prompt_tokens + task.max_tokens
        memory = spec.shard_gb(spec.layers, True, True, context) if spec else 0.5
        demand = (
            (
                task.demand.compute,
                task.demand.memory,
                task.demand.efficiency,
                task.demand.network,
                task.demand.stability,
            )
            if task.demand
            else INFERENCE_DEMAND
        )
        return Task(
            task.request_id,
            TaskKind.INFERENCE,
            demand,
            urgency=task.urgency,
            complexity=min(1.0, context / 4096),
            memory_gb=memory,
            intensity=INFERENCE_INTENSITY,
            work=float(task.max_tokens),
            release=request.ts,
            deadline=task.deadline_ts,
            source=task.source,
        )
    assert isinstance(task, BatchJob)
    return Task(
        task.job_id,
        TaskKind.JOB,
        JOB_DEMAND,
        urgency=task.urgency,
        complexity=min(1.0, task.work_gflop / 1e6),
        memory_gb=task.memory_gb,
        intensity=0.5,
        work=task.work_gflop,
        release=request.ts,
        deadline=task.deadline_ts,
    )


def expected_seconds(request: PlacementRequest, speed_gflops: float) -> float:
    task = request.task
    if isinstance(task, InferenceRequest):
        return task.max_tokens * SECONDS_PER_TOKEN
    assert isinstance(task, BatchJob)
    return task.work_gflop / max(speed_gflops, 1e-3)


def decision_for(
    request: PlacementRequest, placement: Placement, policy: str, mode: Mode, now: float
) -> PlacementDecision:
    return PlacementDecision(
        task_id=request.task_id,
        kind=request.task.kind,
        placed=placement.placed,
        assignments=(Assignment(device_id=placement.device_id),) if placement.device_id else (),
        reason=placement.reason,
        policy=policy,
        mode=mode,
        ts=now,
    )


def assignments_of(preview: Preview) -> tuple[Assignment, ...]:
    return tuple(
        Assignment(
            device_id=s.device_id,
            shard_index=s.shard_index,
            layer_start=s.layer_start,
            layer_end=s.layer_end,
            memory_gb=s.memory_gb,
            vram_gb=s.vram_gb,
            gpu_layers=s.gpu_layers,
        )
        for s in preview.shards
    )
