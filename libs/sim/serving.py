"""Inference serving, simulated: requests routed by a policy to emulated devices.

Event-driven. Arrivals wait for the next decision cycle; the policy places the cycle's batch on
a ``FleetState`` kept in step with the devices; each device runs up to ``slots`` requests at
once (continuous batching) from its own queue, ordered by the policy's queue discipline when it
has one (FCFS otherwise). A device left without work sleeps and wakes for its next request
(``libs/core/energy.py``). A request's time is prefill + one decode step per output token for
the batch it joins (``speed.SpeedModel``); power, heat and battery advance with the emulated
device's models between events; a hot device runs at half clock. Devices may drop out
(scripted faults); their requests are placed again, or counted failed if none can take them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from libs.contracts.profiles import Profile
from libs.core.capability import (
    MEMORY_TYPE_SCORE,
    compute_index,
    efficiency_score,
    network_score,
)
from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.energy import SLEEP_AFTER_S, WAKE_S
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Task, TaskKind, speed_gflops
from libs.core.policy import Policy
from libs.core.queueing import TaskQueue, fcfs_queue
from libs.devices.emulated import EmulatedDevice, FaultKind
from libs.sim.speed import SpeedModel
from libs.sim.workloads import Request

DEMAND = (0.7, 0.5, 0.3, 0.2, 0.3)
#: A request no device can take waits for later cycles this long, then counts as failed.
MAX_WAIT_S = 60.0
#: Idle devices' heat and battery drift slowly: all devices are re-read this often (sim s).
FULL_SYNC_S = 10.0
INTENSITY = 0.02
USABLE_MEMORY = 0.8


@dataclass
class SimDevice:
    emulated: EmulatedDevice
    slots: int
    queue: TaskQueue
    active: dict[str, float] = field(default_factory=dict)  # request id → KV GB
    finish: dict[str, float] = field(default_factory=dict)  # request id → when it ends
    busy_s: float = 0.0
    last_s: float = 0.0
    failed: bool = False
    fail_at: float = math.inf

    def advance(self, now: float) -> None:
        """Power, heat, battery and busy time up to ``now``."""
        dt = now - self.last_s
        if dt > 0:
            self.set_work()
            self.emulated.step(dt, now)
            self.busy_s += dt * min(1.0, len(self.active) / self.slots)
            self.last_s = now

    def set_work(self) -> None:
        """The emulated device's work: the share of its slots its requests fill."""
        self.emulated.work = {"batch": len(self.active) / self.slots} if self.active else {}

    @property
    def clock(self) -> float:
        hot = self.emulated.temperature_c >= self.emulated.capabilities.thermal_limit_c
        return self.emulated.frequency_scale * (0.5 if hot else 1.0)


@dataclass
class Outcome:
    request: Request
    device: str | None = None
    start_s: float = math.nan
    first_token_s: float = math.nan
    done_s: float = math.nan

    @property
    def completed(self) -> bool:
        return not math.isnan(self.done_s)


@dataclass
class SimResult:
    outcomes: list[Outcome]
    devices: list[SimDevice]
    makespan_s: float
    decision_s: list[float]
    wall_s: float


def device_scores(d: EmulatedDevice, need_gb: float) -> tuple[float, float, float, float, float]:
    caps = d.capabilities
    compute = float(compute_index(caps.fp32_tflops, caps.int8_tops, caps.memory_bandwidth_gbps))
    memory = (
        min(1.0, caps.memory_total_gb * USABLE_MEMORY / need_gb)
        * MEMORY_TYPE_SCORE[caps.memory_type]
    )
    return (
        compute,
        memory,
        float(efficiency_score(caps.fp32_tflops, caps.typical_power_w)),
        float(network_score(caps.network_bandwidth_mbps, d.base_rtt_ms)),
        1.0,
    )


class ServingSimulation:
    def __init__(
        self,
        devices: Sequence[EmulatedDevice],
        policy: Policy,
        *,
        model: str,
        slots: int = 8,
        cycle_s: float = 0.2,
        seed: int = 0,
    ) -> None:
        self.speed = SpeedModel(HYPOTHETICAL_MODELS[model])
        self.policy = policy
        self.cycle_s = cycle_s
        self.rng = np.random.default_rng(seed)
        queue_factory = getattr(policy, "queue_factory", fcfs_queue)
        weights = self.speed.model.weights_gb + self.speed.model.runtime_overhead_gb
        self.free_base = [
            max(0.0, d.capabilities.memory_total_gb * USABLE_MEMORY - weights) for d in devices
        ]
        self.devices = [SimDevice(d, slots, queue_factory()) for d in devices]
        profile: Profile | None = getattr(policy, "profile", None)
        for sd in self.devices:
            # the mode's power policy: how soon an idle device sleeps
            sd.emulated.sleep_after_s = profile.sleep_after_s if profile else SLEEP_AFTER_S
            sd.fail_at = min(
                (f.at_s for f in sd.emulated.faults if f.kind == FaultKind.DROP_OUT),
                default=math.inf,
            )
        self.fleet = FleetState([self._device(i, 0.0) for i in range(len(self.devices))])

    def _device(self, i: int, now: float) -> Device:
        sd = self.devices[i]
        e, caps = sd.emulated, sd.emulated.capabilities
        return Device(
            device_id=e.device_id,
            device_class=e.device_class,
            capability=device_scores(e, self.speed.model.weights_gb),
            memory_total_gb=caps.memory_total_gb,
            memory_free_gb=self.free_base[i],
            power_max_w=caps.max_power_w,
            power_now_w=e.power_at(now),
            power_idle_w=e.idle_power_w,
            temperature_c=e.temperature_c,
            thermal_limit_c=caps.thermal_limit_c,
            delta_t_c=caps.delta_t_c,
            speed=speed_gflops(caps.fp32_tflops),
            memory_gbps=caps.memory_bandwidth_gbps,
            slots=sd.slots,
            load=0.0,
            battery_percent=e.battery_percent,
            plugged=e.plugged,
            network_rtt_ms=e.base_rtt_ms,
            network_bandwidth_mbps=caps.network_bandwidth_mbps,
            prefill_tokens_per_s=1.0 / self.speed.prefill_s(caps, 1, 1.0),
            decode_tokens_per_s=1.0 / self.speed.step_s(caps, 1, 1.0),
            backlog_s=0.0,
        )

    def _sync(self, i: int, now: float) -> None:
        sd = self.devices[i]
        sd.advance(now)
        e, caps = sd.emulated, sd.emulated.capabilities
        batch = min(sd.slots, len(sd.active) + 1)
        load = (len(sd.active) + len(sd.queue)) / sd.slots
        self.fleet.set_live_state(
            i,
            load=load,
            memory_free_gb=max(0.0, self.free_base[i] - sum(sd.active.values())),
            power_now_w=min(e.power_at(now), e.capabilities.max_power_w),
            temperature_c=e.temperature_c,
            battery=None if e.battery_percent is None else e.battery_percent / 100.0,
            alive=not sd.failed,
            backlog_s=self._wait_s(sd, now),
            prefill_tokens_per_s=1.0 / self.speed.prefill_s(caps, 1, sd.clock),
            decode_tokens_per_s=1.0 / self.speed.step_s(caps, batch, sd.clock),
            idle_s=e.idle_s,
        )

    def _wait_s(self, sd: SimDevice, now: float) -> float:
        """When a new request would get a slot on ``sd``: its running requests end when they
        end; the queued ones (in queue order) take the slots as they free."""
        if len(sd.active) + len(sd.queue) < sd.slots:
            return 0.0
        free_at = sorted(max(now, t) for t in sd.finish.values())
        free_at += [now] * (sd.slots - len(free_at))
        heapq.heapify(free_at)
        caps = sd.emulated.capabilities
        for task in sd.queue.tasks():
            start = heapq.heappop(free_at)
            _, total = self.speed.service_s(
                caps, task.prompt_tokens, task.output_tokens, sd.slots, sd.clock
            )
            heapq.heappush(free_at, start + total)
        return free_at[0] - now

    def run(self, requests: Sequence[Request]) -> SimResult:
        started = time.perf_counter()
        outcomes = {r.request_id: Outcome(r) for r in requests}
        tasks: dict[str, Task] = {}
        events: list[tuple[float, int, str, str, int]] = []
        seq = itertools.count()
        for r in requests:
            heapq.heappush(events, (r.arrival_s, next(seq), "arrive", r.request_id, -1))
        for i, sd in enumerate(self.devices):
            if sd.fail_at < math.inf:
                heapq.heappush(events, (sd.fail_at, next(seq), "fail", "", i))
        pending: list[str] = []
        dirty: set[int] = set()
        last_full_sync = -math.inf
        cycle_at: float | None = None
        decision_s: list[float] = []
        now = 0.0
        while events:
            now, _, kind, request_id, i = heapq.heappop(events)
            if kind == "arrive":
                r = outcomes[request_id].request
                tasks[request_id] = Task(
                    request_id,
                    TaskKind.INFERENCE,
                    DEMAND,
                    complexity=min(1.0, r.prompt_tokens / 8192),
                    memory_gb=self.speed.kv_gb(r.prompt_tokens, r.output_tokens),
                    intensity=INTENSITY,
                    work=float(r.output_tokens),
                    release=r.arrival_s,
                    source=r.source,
                    prompt_tokens=r.prompt_tokens,
                    output_tokens=r.output_tokens,
                )
                pending.append(request_id)
            elif kind == "cycle":
                cycle_at = None
                batch, pending = [tasks[p] for p in pending], []
                if now - last_full_sync >= FULL_SYNC_S:
                    dirty, last_full_sync = set(range(len(self.devices))), now
                for j in dirty:
                    self._sync(j, now)
                dirty = set()
                t0 = time.perf_counter()
                placements = self.policy.place(self.fleet, batch, now, self.rng)
                decision_s.extend([(time.perf_counter() - t0) / max(1, len(batch))] * len(batch))
                for p in placements:
                    if p.device_id is None:
                        if now - tasks[p.task_id].release < MAX_WAIT_S:
                            pending.append(p.task_id)  # try again next cycle
                        continue
                    j = self.fleet.index[p.device_id]
                    self.devices[j].queue.push(tasks[p.task_id], now)
                    self._start(j, now, outcomes, events, seq)
                    dirty.add(j)
            elif kind == "done":
                sd = self.devices[i]
                if request_id in sd.active and not sd.failed:
                    sd.advance(now)
                    del sd.active[request_id]
                    del sd.finish[request_id]
                    outcomes[request_id].done_s = now
                    self._start(i, now, outcomes, events, seq)
                    dirty.add(i)
            elif kind == "fail":
                sd = self.devices[i]
                sd.advance(now)
                sd.failed = True
                lost = list(sd.active)
                while (item := sd.queue.pop(now)) is not None:
                    lost.append(item[0].task_id)
                sd.active.clear()
                sd.finish.clear()
                dirty.add(i)
                for request_id_lost in lost:
                    outcomes[request_id_lost].device = None
                    outcomes[request_id_lost].start_s = math.nan
                pending.extend(lost)
            if pending and cycle_at is None:
                cycle_at = (math.floor(now / self.cycle_s + 1e-9) + 1) * self.cycle_s
                if cycle_at <= now:  # float rounding at a boundary: never the same instant
                    cycle_at = now + self.cycle_s
                heapq.heappush(events, (cycle_at, next(seq), "cycle", "", -1))
        for sd in self.devices:
            sd.advance(now)
        return SimResult(
            list(outcomes.values()), self.devices, now, decision_s, time.perf_counter() - started
        )

    def _start(
        self,
        i: int,
        now: float,
        outcomes: dict[str, Outcome],
        events: list[tuple[float, int, str, str, int]],
        seq: itertools.count[int],
    ) -> None:
        sd = self.devices[i]
        sd.advance(now)
        while len(sd.active) < sd.slots and (item := sd.queue.pop(now)) is not None:
            task = item[0]
            o = outcomes[task.task_id]
            first, total = self.speed.service_s(
                sd.emulated.capabilities,
                o.request.prompt_tokens,
                o.request.output_tokens,
                len(sd.active) + 1,
                sd.clock,
            )
            if sd.emulated.asleep:  # it wakes first
                first, total = first + WAKE_S, total + WAKE_S
            sd.active[task.task_id] = task.memory_gb
            sd.set_work()  # awake now: requests started with it pay no second wake
            sd.finish[task.task_id] = now + total
            o.device, o.start_s, o.first_token_s = sd.emulated.device_id, now, now + first
            heapq.heappush(events, (now + total, next(seq), "done", task.task_id, i))
