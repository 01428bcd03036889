"""An emulated device: static capabilities drawn from its class, and live state that reacts
to the work assigned to it.

Models (``step`` advances them by ``dt`` seconds):
* the work assigned is a demand (share of full-clock capacity); at clock share f the device is
  busy min(1, demand / f) of the time and serves min(demand, f) of its full-clock throughput,
  so a lower clock saves power while it keeps up and caps throughput when it cannot;
* power = idle + (max − idle) × busy × f³ (``libs/core/energy.py``: dynamic power falls with
  DVFS); a device with no work for ``SLEEP_AFTER_S`` sleeps at a tenth of its idle power;
* temperature follows ambient + idle rise + ΔT × busy × f with time constant τ (first order);
* battery drains by power × dt (Wh) when unplugged and charges at a fixed rate when plugged;
* network round trip and bandwidth jitter around the device's base values (log-normal);
* scripted faults: drop out (stops reporting), overheat (extra heat), battery sag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import get_args

import numpy as np

from libs.contracts import Capabilities, DeviceAnnounce, DeviceClass, GpuSample, TelemetrySample
from libs.contracts.device import Reading, Source
from libs.core.energy import IDLE_SHARE, SLEEP_AFTER_S, SLEEP_SHARE, device_power_w
from libs.devices.classes import CLASS_PROFILES

AMBIENT_C = 25.0
#: Tokens/s of a class-speed-1 device at full load (SmolLM2 on one CPU core, measured).
TOKENS_PER_S_AT_SPEED_1 = 30.0
IDLE_RISE_C = 10.0
CHARGE_W = 20.0


class FaultKind(StrEnum):
    DROP_OUT = "drop_out"
    OVERHEAT = "overheat"
    BATTERY_SAG = "battery_sag"
    POWER_SURGE = "power_surge"  # draws (1 + amount) × its power for the same work


#: Every reading a figure of the device's class.
EMULATED: dict[Reading, Source] = dict.fromkeys(get_args(Reading), "emulated")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    at_s: float
    duration_s: float = float("inf")
    #: overheat: extra °C; battery_sag: the battery level it drops to (percent);
    #: power_surge: the extra share of power drawn.
    amount: float = 0.0

    def active(self, elapsed_s: float) -> bool:
        return self.at_s <= elapsed_s < self.at_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Readings:
    """What a device measured of itself at one moment (emulated, or read from the host); None
    where it cannot measure (readers show unknown, never a number of their own)."""

    cpu_utilisation: float
    memory_available_gb: float
    power_w: float | None
    temperature_c: float | None
    battery_percent: float | None
    plugged: bool | None
    gpu: GpuSample | None = None
    #: None: the device's own base figures (a host does not measure its network).
    network_rtt_ms: float | None = None
    network_bandwidth_mbps: float | None = None
    measured_tokens_per_s: float | None = None
    energy_j: float | None = None
    frequency_scale: float = 1.0


def _draw(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    low, high = bounds
    return float(rng.uniform(low, high)) if high > low else float(low)


@dataclass
class EmulatedDevice:
    device_id: str
    device_class: DeviceClass
    capabilities: Capabilities
    base_rtt_ms: float
    battery_wh: float
    speed_factor: float
    thermal_tau_s: float
    faults: tuple[Fault, ...] = ()
    temperature_c: float = AMBIENT_C + IDLE_RISE_C
    battery_percent: float | None = None
    plugged: bool = True
    frequency_scale: float = 1.0
    started_at: float = 0.0
    work: dict[str, float] = field(default_factory=dict)  # task id → intensity
    reserved_memory_gb: float = 0.0
    energy_j: float = 0.0
    #: Seconds since the device last had work (it sleeps after ``SLEEP_AFTER_S``).
    idle_s: float = 0.0
    #: Worker engines that run model shards on this device (empty: none).
    engines: tuple[str, ...] = ()
    #: Where this device's llama.cpp RPC server listens (a ``llamacpp`` worker sets it).
    rpc_endpoint: str | None = None
    #: GPU memory its llama.cpp offloads layers to (a CUDA build on a GPU host sets it).
    vram_gb: float | None = None
    #: A worker's capacity: requests its engine serves at once, and each one's context where
    #: a task names none (None: no worker, the scheduler assumes its engine's defaults).
    slots: int | None = None
    context_length: int | None = None
    #: Set by a real worker: its measured rate replaces the emulated one.
    measured_tokens_per_s: float | None = None
    #: Set by a real worker: the FP32 GFLOP/s its recent model steps achieved.
    measured_gflops: float | None = None
    #: Set by a worker held to a memory limit: the room the limit leaves beside the worker
    #: itself (GB), its memory reading in place of its class's share of its total.
    memory_available_gb: float | None = None
    #: Where each reading comes from (``libs/contracts/device.py: Source``): all its class's.
    sources: dict[Reading, Source] = field(default_factory=lambda: dict(EMULATED))
    #: Set by a real worker: the requests it serves or queues. None: an emulated device, whose
    #: tasks each count as one request it serves (what the scheduler's auto mode reads as demand).
    queue_depth: int | None = None
    #: Seconds without work before it sleeps: the power policy of the scheduling mode.
    sleep_after_s: float = SLEEP_AFTER_S

    @property
    def memory_limit_gb(self) -> float:
        """The memory shards may take here (a host device may be capped below its own)."""
        return self.capabilities.memory_total_gb

    @classmethod
    def draw(
        cls, device_id: str, device_class: DeviceClass, rng: np.random.Generator, now: float = 0.0
    ) -> EmulatedDevice:
        """A device of ``device_class`` with figures drawn from the class's ranges."""
        p = CLASS_PROFILES[device_class]
        typical = _draw(rng, p.typical_power_w)
        caps = Capabilities(
            fp32_tflops=_draw(rng, p.fp32_tflops),
            int8_tops=_draw(rng, p.int8_tops),
            memory_bandwidth_gbps=_draw(rng, p.bandwidth_gbps),
            memory_total_gb=round(_draw(rng, p.memory_gb), 1),
            memory_type=p.memory_types[int(rng.integers(len(p.memory_types)))],
            typical_power_w=typical,
            max_power_w=typical * p.peak_ratio,
            thermal_limit_c=p.thermal_limit_c,
            delta_t_c=_draw(rng, p.delta_t_c),
            has_battery=p.has_battery,
            gpu_count=int(rng.integers(p.gpu_count[0], p.gpu_count[1] + 1)),
            network_bandwidth_mbps=_draw(rng, p.network_mbps),
        )
        battery = float(rng.uniform(40, 100)) if p.has_battery else None
        plugged = not p.has_battery or bool(rng.random() < 0.3)
        return cls(
            device_id,
            device_class,
            caps,
            _draw(rng, p.rtt_ms),
            _draw(rng, p.battery_wh),
            p.speed_factor,
            p.thermal_tau_s,
            battery_percent=battery,
            plugged=plugged,
            started_at=now,
        )

    # -- state ------------------------------------------------------------------------------
    @property
    def demand(self) -> float:
        return min(1.0, sum(self.work.values()))

    @property
    def utilisation(self) -> float:
        """Share of time busy at the current clock."""
        return min(1.0, self.demand / self.frequency_scale)

    @property
    def idle_power_w(self) -> float:
        return self.capabilities.typical_power_w * IDLE_SHARE

    @property
    def asleep(self) -> bool:
        return not self.work and self.idle_s >= self.sleep_after_s

    @property
    def power_w(self) -> float:
        if self.asleep:
            return self.idle_power_w * SLEEP_SHARE
        return float(
            device_power_w(
                self.idle_power_w,
                self.capabilities.max_power_w,
                self.utilisation,
                self.frequency_scale,
            )
        )

    def power_at(self, now: float) -> float:
        """Power including an active power-surge fault."""
        elapsed = now - self.started_at
        surge = sum(
            f.amount for f in self.faults if f.kind == FaultKind.POWER_SURGE and f.active(elapsed)
        )
        return self.power_w * (1.0 + surge)

    @property
    def tokens_per_s(self) -> float:
        served = min(self.demand, self.frequency_scale)
        return TOKENS_PER_S_AT_SPEED_1 * self.speed_factor * served

    def _measured(self) -> float | None:
        if self.measured_tokens_per_s is not None:
            return self.measured_tokens_per_s
        return self.tokens_per_s if self.work else None

    def reporting(self, now: float) -> bool:
        """False while a drop-out fault is active: the device sends nothing."""
        elapsed = now - self.started_at
        return not any(f.kind == FaultKind.DROP_OUT and f.active(elapsed) for f in self.faults)

    def assign(self, task_id: str, intensity: float, memory_gb: float = 0.0) -> None:
        if task_id not in self.work:
            self.reserved_memory_gb += memory_gb
        self.work[task_id] = max(0.0, min(1.0, intensity))

    def unassign(self, task_id: str, memory_gb: float = 0.0) -> None:
        if self.work.pop(task_id, None) is not None:
            self.reserved_memory_gb = max(0.0, self.reserved_memory_gb - memory_gb)

    def step(self, dt: float, now: float) -> None:
        """Advance power, heat and battery by ``dt`` seconds."""
        if dt <= 0:
            return
        elapsed = now - self.started_at
        extra_heat = sum(
            f.amount for f in self.faults if f.kind == FaultKind.OVERHEAT and f.active(elapsed)
        )
        target = (
            AMBIENT_C
            + IDLE_RISE_C
            + self.capabilities.delta_t_c * self.utilisation * self.frequency_scale
            + extra_heat
        )
        self.temperature_c += (target - self.temperature_c) * (
            1 - math.exp(-dt / self.thermal_tau_s)
        )
        power = self.power_at(now)
        if not self.work:  # awake until sleep_after_s without work, asleep after
            awake_s = min(dt, max(0.0, self.sleep_after_s - self.idle_s))
            self.idle_s += awake_s
            power = (power * awake_s + self.power_at(now) * (dt - awake_s)) / dt
            self.idle_s += dt - awake_s
        else:
            self.idle_s = 0.0
        self.energy_j += power * dt
        if self.battery_percent is not None and self.battery_wh > 0:
            watts = CHARGE_W if self.plugged else -power
            self.battery_percent += watts * dt / 3600.0 / self.battery_wh * 100.0
            for f in self.faults:
                if f.kind == FaultKind.BATTERY_SAG and f.active(elapsed):
                    self.battery_percent = min(self.battery_percent, f.amount)
            self.battery_percent = min(100.0, max(0.0, self.battery_percent))

    # -- messages ---------------------------------------------------------------------------
    def announce(self, now: float, interval_s: float) -> DeviceAnnounce:
        return DeviceAnnounce(
            device_id=self.device_id,
            device_class=self.device_class,
            capabilities=self.capabilities,
            emulated=True,
            sources=self.sources,
            interval_s=interval_s,
            engines=self.engines,
            rpc_endpoint=self.rpc_endpoint,
            vram_gb=self.vram_gb,
            slots=self.slots,
            context_length=self.context_length,
            ts=now,
        )

    def read(self, now: float, rng: np.random.Generator) -> Readings:
        """The emulated readings at ``now`` (a host device reads its own instead)."""
        caps = self.capabilities
        jitter = float(rng.lognormal(0.0, 0.2))
        # a measured network (a worker on a link of its own) is read as measured, unjittered
        link = 1.0 if self.sources.get("network") == "measured" else jitter
        share = caps.memory_total_gb * 0.8
        room = share if self.memory_available_gb is None else self.memory_available_gb
        available = max(0.0, room - self.reserved_memory_gb)
        return Readings(
            cpu_utilisation=self.utilisation,
            memory_available_gb=min(available, caps.memory_total_gb),
            power_w=self.power_at(now),
            temperature_c=min(self.temperature_c, 199.0),
            battery_percent=self.battery_percent,
            plugged=self.plugged if caps.has_battery else None,
            network_rtt_ms=self.base_rtt_ms * link,
            network_bandwidth_mbps=caps.network_bandwidth_mbps / link,
            measured_tokens_per_s=self._measured(),
            energy_j=self.energy_j,
            frequency_scale=self.frequency_scale,
        )

    def sample(self, seq: int, now: float, rng: np.random.Generator) -> TelemetrySample:
        """This device's telemetry sample: its ``read`` and the work it holds. The one builder
        of a device's ``TelemetrySample`` (emulated devices, a worker's host, the host agent)."""
        read = self.read(now, rng)
        measured = {f.name: getattr(read, f.name) for f in fields(read)}
        if read.network_rtt_ms is None:
            measured["network_rtt_ms"] = self.base_rtt_ms
        if read.network_bandwidth_mbps is None:
            measured["network_bandwidth_mbps"] = self.capabilities.network_bandwidth_mbps
        return TelemetrySample(
            device_id=self.device_id,
            seq=seq,
            ts=now,
            memory_total_gb=self.capabilities.memory_total_gb,
            running_tasks=len(self.work),
            queue_depth=len(self.work) if self.queue_depth is None else self.queue_depth,
            measured_gflops=self.measured_gflops,
            **measured,
        )
