"""Device-side messages: announce, telemetry (each sample is the device's heartbeat), score
updates, failure and recovery."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from libs.contracts.base import (
    DeviceClass,
    DeviceId,
    Endpoint,
    Fraction,
    MemoryType,
    Mode,
    TemperatureC,
    Timestamp,
    WireModel,
)

NonNegative = Annotated[float, Field(ge=0.0)]
MemoryGb = Annotated[float, Field(ge=0.0, le=65536.0)]
PowerW = Annotated[float, Field(ge=0.0, le=100_000.0)]


class Capabilities(WireModel):
    """What a device can do, measured (calibration) or declared (emulated class).

    Units are in the field names. ``delta_t_c`` is the temperature rise at full load over the
    current temperature (°C per unit of task intensity).
    """

    fp32_tflops: Annotated[float, Field(ge=0.0, le=100_000.0)]
    int8_tops: Annotated[float, Field(ge=0.0, le=100_000.0)]
    memory_bandwidth_gbps: Annotated[float, Field(ge=0.0, le=100_000.0)]
    memory_total_gb: Annotated[float, Field(gt=0.0, le=65536.0)]
    memory_type: MemoryType
    typical_power_w: Annotated[float, Field(gt=0.0, le=100_000.0)]
    max_power_w: Annotated[float, Field(gt=0.0, le=100_000.0)]
    thermal_limit_c: Annotated[float, Field(ge=40.0, le=150.0)]
    delta_t_c: Annotated[float, Field(ge=0.0, le=150.0)]
    has_battery: bool
    gpu_count: Annotated[int, Field(ge=0, le=1024)] = 0
    network_bandwidth_mbps: Annotated[float, Field(ge=0.0, le=1_000_000.0)]

    @model_validator(mode="after")
    def _power_order(self) -> Capabilities:
        if self.max_power_w < self.typical_power_w:
            raise ValueError("max_power_w must be at least typical_power_w")
        return self


#: Where a device's reading comes from: ``measured`` on the host (a calibration, psutil, RAPL,
#: NVML), ``enforced`` by the kernel (a cgroup's memory limit), ``estimated`` by a model from
#: a measurement (the host's measured speed times an emulated class's factor), or
#: ``emulated`` (a figure of its class, ``libs/devices/classes.py``).
Source = Literal["measured", "enforced", "estimated", "emulated"]
#: The readings a source is given for: ``speed`` (the FLOP/s and bandwidth announced),
#: ``memory``, ``power``, ``temperature``, ``network`` (round trip and bandwidth).
Reading = Literal["speed", "memory", "power", "temperature", "network"]


class DeviceAnnounce(WireModel):
    """Sent once when an agent starts (and again on request) with the device's static facts."""

    device_id: DeviceId
    device_class: DeviceClass
    capabilities: Capabilities
    emulated: bool
    #: Where each of its readings comes from (a reading left out: not said).
    sources: dict[Reading, Source] = Field(default_factory=dict)
    #: How often the agent reports (s); the failure detector waits 3 of these.
    interval_s: Annotated[float, Field(ge=0.05, le=60.0)] = 5.0
    #: Worker engines that run model shards here ("torch", "vllm"); empty: no worker.
    engines: tuple[Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$")], ...] = Field(
        default=(), max_length=8
    )
    #: Where this device's llama.cpp RPC server listens (a ``llamacpp`` worker), else None.
    rpc_endpoint: Endpoint | None = None
    #: Requests its worker engine serves at once (llama.cpp's slots, vLLM's sequences; the
    #: torch ring: 1). None: no worker (the scheduler then assumes its engine's default).
    #: The scheduler sizes a plan's KV cache with it.
    slots: Annotated[int, Field(ge=1, le=1024)] | None = None
    #: The longest context its worker engine gives a request, tokens (vLLM's
    #: ``--max-model-len``, fixed when it starts). None: no bound of its own (llama.cpp and
    #: the torch ring size their cache to each deployment's context). The scheduler leaves
    #: this device out of a deployment with a longer context, saying so, and a deployment
    #: that names none gets no more than the longest its able workers announce.
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    #: GPU memory (GB) its worker engine offloads a model's layers to (llama.cpp built with
    #: CUDA, on a host whose GPU NVML reads), counted apart from host memory; its free part is
    #: each sample's ``gpu`` reading. None: its engine serves from host memory only.
    vram_gb: MemoryGb | None = None
    ts: Timestamp


class AnnounceRequest(WireModel):
    """Asks every agent to announce its devices again (sent by a scorer that starts)."""

    reason: Annotated[str, Field(min_length=1, max_length=200)]
    ts: Timestamp


class GpuSample(WireModel):
    utilisation: Fraction
    memory_used_gb: MemoryGb
    memory_total_gb: MemoryGb
    power_w: PowerW
    temperature_c: TemperatureC


class TelemetrySample(WireModel):
    """A periodic measurement of one device (default every 5 s). It is the device's heartbeat:
    the scorer declares a device failed after ``missed_heartbeats`` intervals without one."""

    device_id: DeviceId
    seq: Annotated[int, Field(ge=0)]
    ts: Timestamp
    cpu_utilisation: Fraction
    memory_total_gb: Annotated[float, Field(gt=0.0, le=65536.0)]
    memory_available_gb: MemoryGb
    #: None: the device cannot measure it (a host without RAPL or a discharging battery, a
    #: VM without sensors); readers say unknown, never a number of their own.
    power_w: PowerW | None
    temperature_c: TemperatureC | None
    battery_percent: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    plugged: bool | None = None
    network_rtt_ms: Annotated[float, Field(ge=0.0, le=600_000.0)]
    network_bandwidth_mbps: Annotated[float, Field(ge=0.0, le=1_000_000.0)]
    running_tasks: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    queue_depth: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    measured_tokens_per_s: Annotated[float, Field(ge=0.0, le=10_000_000.0)] | None = None
    #: FP32 GFLOP/s the device achieved on its recent work (a worker's measurement of itself);
    #: the scorer trusts it over the announced ``fp32_tflops`` (see ``libs/core/honesty.py``).
    measured_gflops: Annotated[float, Field(ge=0.0, le=100_000_000.0)] | None = None
    energy_j: NonNegative | None = None
    frequency_scale: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    gpu: GpuSample | None = None

    @model_validator(mode="after")
    def _memory_fits(self) -> TelemetrySample:
        if self.memory_available_gb > self.memory_total_gb:
            raise ValueError("memory_available_gb exceeds memory_total_gb")
        return self


class ScoreUpdate(WireModel):
    """A device scored: the five capability dimensions and their weighted total, each in
    [0, 1], with what they were computed from, i.e. everything the scorer wrote to the device's
    row with them (``libs/contracts/keys.py``), so that a reader applies the update as sent
    and reads Redis only for a device it knows nothing of.

    ``sample`` is the telemetry sample scored; ``speed_scale`` what the device's claimed speed
    was scaled by (1: it measures as fast as it claims); ``announced_ts`` the ``ts`` of the
    announce the scores are for (a reader holding an older one reads the device's new one).
    """

    device_id: DeviceId
    device_class: DeviceClass
    ts: Timestamp
    mode: Mode
    compute: Fraction
    memory: Fraction
    efficiency: Fraction
    network: Fraction
    stability: Fraction
    total: Fraction
    sample: TelemetrySample
    speed_scale: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    announced_ts: Timestamp


class DeviceFailed(WireModel):
    """A device sent no telemetry sample for ``missed_heartbeats`` intervals (3 by default)."""

    device_id: DeviceId
    ts: Timestamp
    last_seen_ts: Timestamp
    missed_heartbeats: Annotated[int, Field(ge=1)]


class DeviceLeaving(WireModel):
    """A device is about to leave (Ctrl-C on ``tessera join``): the scorer declares it failed
    at once, so its work moves while it still serves; it exits once its shards are gone."""

    device_id: DeviceId
    ts: Timestamp
    reason: Annotated[str, Field(min_length=1, max_length=200)]


class DeviceRecovered(WireModel):
    device_id: DeviceId
    ts: Timestamp
    down_for_s: NonNegative


class DvfsHint(WireModel):
    """A frequency hint: ``frequency_scale`` of the device's nominal clock, in (0, 1]."""

    device_id: DeviceId
    ts: Timestamp
    frequency_scale: Annotated[float, Field(gt=0.0, le=1.0)]
    reason: Annotated[str, Field(min_length=1, max_length=200)]
    #: The mode's power policy: seconds without work before the device sleeps (None: its own).
    sleep_after_s: Annotated[float, Field(gt=0.0, le=3600.0)] | None = None
