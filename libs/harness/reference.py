"""Compare online policies with the exact optimum on random small instances
(``libs/core/exact.py``'s MILP).

An instance is a list of jobs (release, work, memory) and machines (speed, memory). Each
policy is run online through ``exact.list_schedule``: at a job's release the policy sees the
fleet as ``Device`` values whose ``load`` is the machine's backlog in units of that job's
service time there, and places the job; machines then run FCFS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from libs.contracts import DeviceClass
from libs.core.capability import log_scale
from libs.core.exact import Job, Machine, Schedule, list_schedule, solve
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Task
from libs.core.policies import make_policy

SPEED_RANGE = (0.5, 8.0)


@dataclass(frozen=True, slots=True)
class Instance:
    jobs: tuple[Job, ...]
    machines: tuple[Machine, ...]


def random_instance(
    rng: np.random.Generator, max_jobs: int = 12, max_machines: int = 5
) -> Instance:
    n = int(rng.integers(2, max_jobs + 1))
    m = int(rng.integers(2, max_machines + 1))
    machines = tuple(
        Machine(float(rng.uniform(*SPEED_RANGE)), float(rng.choice([2.0, 4.0, 8.0, 16.0])))
        for _ in range(m)
    )
    biggest = max(mc.memory_gb for mc in machines)
    jobs = tuple(
        Job(
            release=float(rng.uniform(0, 10)),
            work=float(rng.uniform(1, 20)),
            memory_gb=float(rng.uniform(0, biggest)),
        )
        for _ in range(n)
    )
    return Instance(jobs, machines)


def _devices(machines: Sequence[Machine], backlog_s: Sequence[float], job: Job) -> list[Device]:
    devices = []
    for j, (mc, backlog) in enumerate(zip(machines, backlog_s, strict=True)):
        service_s = max(job.work / mc.speed, 1e-9)
        compute = float(log_scale(mc.speed, *SPEED_RANGE))
        devices.append(
            Device(
                device_id=f"m{j}",
                device_class=DeviceClass.WORKSTATION,
                capability=(compute, 0.5, 0.5, 0.5, 1.0),
                memory_total_gb=min(mc.memory_gb, 1e6),
                memory_free_gb=min(mc.memory_gb, 1e6),
                power_max_w=1e6,
                power_now_w=0.0,
                power_idle_w=1.0,
                temperature_c=30.0,
                thermal_limit_c=95.0,
                delta_t_c=0.0,
                speed=mc.speed,
                load=backlog / service_s,
            )
        )
    return devices


def run_policy(name: str, instance: Instance, seed: int = 0) -> Schedule:
    policy = make_policy(name)
    rng = np.random.default_rng(seed)

    def choose(i: int, now: float, backlog: Sequence[float]) -> int:
        job = instance.jobs[i]
        fleet = FleetState(_devices(instance.machines, backlog, job))
        task = Task(
            f"j{i}",
            demand=(0.8, 0.2, 0.0, 0.0, 0.0),
            memory_gb=job.memory_gb,
            work=job.work,
            release=job.release,
            intensity=0.1,
            source=f"s{i}",
        )
        [placement] = policy.place(fleet, [task], now, rng)
        if placement.device_id is None:
            raise ValueError(f"{name} could not place job {i}: {placement.reason}")
        return fleet.index[placement.device_id]

    return list_schedule(instance.jobs, instance.machines, choose)


def optimum(instance: Instance) -> Schedule:
    return solve(instance.jobs, instance.machines)
