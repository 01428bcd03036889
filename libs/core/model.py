"""Devices, tasks and the five capability dimensions, as plain immutable values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from libs.contracts import DeviceClass

#: Order of the five dimensions in every capability and demand vector.
DIMENSIONS = ("compute", "memory", "efficiency", "network", "stability")
Vector5 = tuple[float, float, float, float, float]


class TaskKind(StrEnum):
    INFERENCE = "inference"
    SHARD = "shard"
    JOB = "job"


def _check_fraction_vector(name: str, values: Vector5) -> None:
    if len(values) != 5:
        raise ValueError(f"{name} needs 5 values ({', '.join(DIMENSIONS)})")
    for dim, value in zip(DIMENSIONS, values, strict=True):
        if not (0.0 <= value <= 1.0) or math.isnan(value):
            raise ValueError(f"{name}.{dim} must be in [0, 1], got {value}")


#: The least ``Device.speed`` (GFLOP/s) a device is given, so that a duration stays finite.
MIN_SPEED_GFLOPS = 1e-3


def speed_gflops(fp32_tflops: float, scale: float = 1.0) -> float:
    """``Device.speed`` (GFLOP/s) of a device announcing ``fp32_tflops``, its claims scaled by
    ``scale`` (the scorer's, when the device measures far slower than it claims)."""
    return max(fp32_tflops * 1000.0 * scale, MIN_SPEED_GFLOPS)


@dataclass(frozen=True, slots=True)
class Device:
    """One device as the scheduler sees it: scores plus live state.

    ``capability`` is the five scored dimensions in [0, 1] (see ``capability.py``).
    ``speed`` is the device's effective fp32 rate in GFLOP/s (``speed_gflops`` turns the
    TFLOPS a device announces into it, wherever a ``Device`` is built), used with
    ``Task.work`` to estimate durations; ``slots`` is how many tasks it runs at once; ``load``
    is the number of tasks it is running or has queued, divided by ``slots``.

    Where they are known (measured, or modelled by the simulator), ``prefill_tokens_per_s`` and
    ``decode_tokens_per_s`` (one stream's rates at the device's current batch) give an LLM
    request's own time there, and ``backlog_s`` the seconds a new task waits for a slot; 0 and
    None mean unknown: durations then come from ``work / speed`` and the wait from ``load``.
    """

    device_id: str
    device_class: DeviceClass
    capability: Vector5
    memory_total_gb: float
    memory_free_gb: float
    power_max_w: float
    power_now_w: float
    power_idle_w: float
    temperature_c: float
    thermal_limit_c: float
    delta_t_c: float
    speed: float = 1.0
    #: Memory bandwidth (GB/s) as calibrated; 0 when unknown.
    memory_gbps: float = 0.0
    slots: int = 1
    load: float = 0.0
    battery_percent: float | None = None
    plugged: bool = True
    network_rtt_ms: float = 1.0
    network_bandwidth_mbps: float = 1000.0
    failed: bool = False
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    backlog_s: float | None = None
    #: Seconds since it last had work (it sleeps after ``energy.SLEEP_AFTER_S``).
    idle_s: float = 0.0
    #: GPU memory (GB) its engine may offload a model's layers to, counted apart from
    #: ``memory_free_gb``: llama.cpp built with CUDA on a host with a GPU (the head's server
    #: and its RPC server both serve from it).
    vram_free_gb: float = 0.0

    def __post_init__(self) -> None:
        _check_fraction_vector("capability", self.capability)
        if self.prefill_tokens_per_s < 0 or self.decode_tokens_per_s < 0:
            raise ValueError(f"{self.device_id}: token rates must not be negative")
        if self.backlog_s is not None and self.backlog_s < 0:
            raise ValueError(f"{self.device_id}: backlog_s must not be negative")
        if self.memory_total_gb <= 0 or not 0 <= self.memory_free_gb <= self.memory_total_gb:
            raise ValueError(f"{self.device_id}: memory_free_gb must be in [0, memory_total_gb]")
        if not 0 < self.power_idle_w <= self.power_max_w or self.power_now_w < 0:
            raise ValueError(f"{self.device_id}: need 0 < power_idle_w <= power_max_w")
        if self.vram_free_gb < 0:
            raise ValueError(f"{self.device_id}: vram_free_gb must not be negative")
        if self.speed <= 0 or self.slots < 1 or self.load < 0 or self.delta_t_c < 0:
            raise ValueError(f"{self.device_id}: speed, slots, load and delta_t_c must be positive")
        if self.battery_percent is not None and not 0 <= self.battery_percent <= 100:
            raise ValueError(f"{self.device_id}: battery_percent must be in [0, 100]")

    @property
    def on_battery(self) -> bool:
        return self.battery_percent is not None and not self.plugged


@dataclass(frozen=True, slots=True)
class Task:
    """A unit of work to place.

    ``demand`` is what the task needs along the five dimensions (its direction is what counts
    for the cosine match); ``intensity`` in (0, 1] is the share of a device's compute it keeps
    busy (drives the power and thermal predictions); ``work`` is in the same units as
    ``Device.speed`` × seconds; ``release`` and ``deadline`` are absolute seconds. An LLM
    request also gives its ``prompt_tokens`` and ``output_tokens`` (0: not an LLM request).
    """

    task_id: str
    kind: TaskKind = TaskKind.INFERENCE
    demand: Vector5 = (0.6, 0.2, 0.1, 0.05, 0.05)
    urgency: float = 0.5
    complexity: float = 0.5
    memory_gb: float = 0.0
    intensity: float = 0.5
    work: float = 1.0
    release: float = 0.0
    deadline: float | None = None
    source: str = ""
    priority: int = 0
    bid: float = 1.0
    prompt_tokens: int = 0
    output_tokens: int = 0

    def __post_init__(self) -> None:
        _check_fraction_vector("demand", self.demand)
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"{self.task_id}: token counts must not be negative")
        if sum(self.demand) == 0:
            raise ValueError(f"{self.task_id}: demand must not be all zero")
        if not (0 <= self.urgency <= 1 and 0 <= self.complexity <= 1):
            raise ValueError(f"{self.task_id}: urgency and complexity must be in [0, 1]")
        if not 0 < self.intensity <= 1:
            raise ValueError(f"{self.task_id}: intensity must be in (0, 1]")
        if self.memory_gb < 0 or self.work < 0 or self.bid < 0:
            raise ValueError(f"{self.task_id}: memory_gb, work and bid must not be negative")
        if self.deadline is not None and self.deadline < self.release:
            raise ValueError(f"{self.task_id}: deadline is before release")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one task went, or why it could not go anywhere (``device_id`` is None)."""

    task_id: str
    device_id: str | None
    score: float = 0.0
    reason: str | None = None

    @property
    def placed(self) -> bool:
        return self.device_id is not None
