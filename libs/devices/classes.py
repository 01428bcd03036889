"""Device classes and the ranges each class's devices are drawn from.

Power, memory and the class list are those Tessera was designed for: phone 5–15 W, 4–12 GB;
laptop 15–45 W, 8–32 GB; watch < 2 W, 1–4 GB; workstation 65–300 W, 16–128 GB; plus edge
servers and cloud GPU servers (EdgeFlow's jobs). Compute, bandwidth and network figures are
typical of current hardware in each class (mobile NPU/GPU, laptop iGPU, desktop GPU,
T4/Jetson-class edge boxes, A100/H100 servers).
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.contracts import DeviceClass, MemoryType

Range = tuple[float, float]


@dataclass(frozen=True, slots=True)
class ClassProfile:
    typical_power_w: Range
    memory_gb: Range
    memory_types: tuple[MemoryType, ...]
    fp32_tflops: Range
    int8_tops: Range
    bandwidth_gbps: Range
    network_mbps: Range
    rtt_ms: Range
    delta_t_c: Range
    thermal_limit_c: float
    has_battery: bool
    battery_wh: Range = (0.0, 0.0)
    gpu_count: tuple[int, int] = (0, 0)
    #: Relative speed of an emulated worker of this class (1 = this machine's CPU).
    speed_factor: float = 1.0
    #: Max power as a multiple of typical power.
    peak_ratio: float = 1.4
    #: Thermal time constant (s): how fast temperature follows load.
    thermal_tau_s: float = 60.0


CLASS_PROFILES: dict[DeviceClass, ClassProfile] = {
    DeviceClass.PHONE: ClassProfile(
        (5, 15),
        (4, 12),
        (MemoryType.LPDDR5, MemoryType.LPDDR4),
        (0.5, 2.5),
        (5, 45),
        (30, 77),
        (50, 400),
        (5, 30),
        (15, 25),
        85.0,
        True,
        (12, 20),
        speed_factor=0.3,
        thermal_tau_s=40.0,
    ),
    DeviceClass.LAPTOP: ClassProfile(
        (15, 45),
        (8, 32),
        (MemoryType.LPDDR5, MemoryType.DDR5, MemoryType.DDR4),
        (2, 10),
        (10, 50),
        (50, 120),
        (100, 1000),
        (2, 10),
        (20, 30),
        85.0,
        True,
        (45, 100),
        speed_factor=0.8,
        thermal_tau_s=60.0,
    ),
    DeviceClass.WATCH: ClassProfile(
        (0.5, 1.9),
        (1, 4),
        (MemoryType.LPDDR4,),
        (0.01, 0.05),
        (0.1, 1.0),
        (5, 15),
        (1, 20),
        (20, 80),
        (5, 10),
        85.0,
        True,
        (0.8, 1.5),
        speed_factor=0.02,
        peak_ratio=1.05,
        thermal_tau_s=30.0,
    ),
    DeviceClass.WORKSTATION: ClassProfile(
        (65, 300),
        (16, 128),
        (MemoryType.DDR5, MemoryType.DDR4),
        (10, 80),
        (100, 660),
        (100, 1000),
        (1000, 10000),
        (0.5, 2),
        (20, 35),
        95.0,
        False,
        speed_factor=3.0,
        thermal_tau_s=90.0,
    ),
    DeviceClass.EDGE_SERVER: ClassProfile(
        (50, 250),
        (16, 64),
        (MemoryType.DDR4, MemoryType.DDR5),
        (5, 60),
        (50, 260),
        (100, 320),
        (1000, 10000),
        (2, 10),
        (20, 30),
        95.0,
        False,
        gpu_count=(0, 2),
        speed_factor=2.0,
        thermal_tau_s=120.0,
    ),
    DeviceClass.CLOUD_GPU: ClassProfile(
        (300, 700),
        (80, 640),
        (MemoryType.HBM,),
        (20, 500),
        (600, 4000),
        (2000, 3350),
        (10000, 100000),
        (15, 45),
        (15, 25),
        95.0,
        False,
        gpu_count=(1, 8),
        speed_factor=20.0,
        peak_ratio=1.3,
        thermal_tau_s=120.0,
    ),
}
