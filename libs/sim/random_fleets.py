"""Random fleets and tasks for the scheduler's benchmark (``bench/scheduler.py``) and the test
that holds its decisions (``tests/unit/core/test_recorded_decisions.py``): the same draws in
the same order for a given generator, so a recorded decision stays the one the benchmark
measures. (``tests/unit/core/test_search.py`` draws harder fleets of its own on purpose:
twins, failed devices, full memory.)"""

from __future__ import annotations

import numpy as np

from libs.contracts import DeviceClass
from libs.core.model import Device, Task

CLASSES = list(DeviceClass)


def random_fleet(n: int, rng: np.random.Generator) -> list[Device]:
    devices = []
    for i in range(n):
        memory = float(rng.uniform(1, 128))
        power_max = float(rng.uniform(2, 400))
        on_battery = bool(rng.random() < 0.4)
        devices.append(
            Device(
                device_id=f"d{i}",
                device_class=CLASSES[i % len(CLASSES)],
                capability=tuple(rng.uniform(0.05, 1.0, 5).tolist()),
                memory_total_gb=memory,
                memory_free_gb=memory * float(rng.uniform(0.2, 1.0)),
                power_max_w=power_max,
                power_now_w=power_max * float(rng.uniform(0.05, 0.5)),
                power_idle_w=power_max * 0.05,
                temperature_c=float(rng.uniform(25, 70)),
                thermal_limit_c=85.0 if i % 2 else 95.0,
                delta_t_c=float(rng.uniform(5, 30)),
                speed=float(rng.uniform(0.5, 50)),
                slots=int(rng.integers(1, 16)),
                battery_percent=float(rng.uniform(1, 100)) if on_battery else None,
                plugged=not on_battery,
            )
        )
    return devices


def random_tasks(n: int, rng: np.random.Generator) -> list[Task]:
    return [
        Task(
            f"t{i}",
            demand=tuple(rng.uniform(0.0, 1.0, 5).tolist()),
            urgency=float(rng.random()),
            complexity=float(rng.random()),
            memory_gb=float(rng.uniform(0.01, 2.0)),
            intensity=float(rng.uniform(0.001, 0.01)),
        )
        for i in range(n)
    ]
