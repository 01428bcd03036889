"""The scheduler's view of a device that reports no temperature or power: its heat model
starts from a room's, its power is modelled from its load, and the cluster's tokens/J counts
only devices that measure their power."""

from __future__ import annotations

import numpy as np

from libs.contracts import DeviceAnnounce, DeviceClass
from libs.contracts.keys import SCORE_FIELDS, DeviceRow
from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.energy import IDLE_SHARE, cluster_rates
from libs.core.policies import make_policy
from libs.devices.fleetfile import build, load_fleet
from libs.sim.serving import ServingSimulation, device_scores
from services.scheduler.view import ROOM_C, to_device
from tests.builders import NOW, make_capabilities, make_telemetry

MODEL = "llama-3.2-1b-instruct"


def test_unknown_readings_become_the_models_not_zeros() -> None:
    caps = make_capabilities()
    announce = DeviceAnnounce(
        device_id="host-a",
        device_class=DeviceClass.WORKSTATION,
        capabilities=caps,
        emulated=False,
        ts=NOW,
    )
    sample = make_telemetry("host-a", power_w=None, temperature_c=None, cpu_utilisation=0.5)
    row = DeviceRow(device_id="host-a", sample=sample, total=0.5, compute=0.5)
    device = to_device(row, announce, load=0.0, reserved_gb=0.0)
    assert device.temperature_c == ROOM_C
    modelled = caps.typical_power_w * (IDLE_SHARE + (1 - IDLE_SHARE) * 0.5)
    assert device.power_now_w == min(modelled, caps.max_power_w)


def test_tokens_per_joule_counts_only_devices_that_measure_their_power() -> None:
    metered = make_telemetry("a", power_w=10.0, measured_tokens_per_s=20.0)
    unknown = make_telemetry("b", power_w=None, measured_tokens_per_s=30.0)
    tokens, per_joule = cluster_rates([metered, unknown])
    assert tokens == 50.0
    assert per_joule == 2.0


def test_the_simulator_and_the_live_view_build_the_same_device_from_one_sample() -> None:
    """One emulated device's announce and telemetry sample, scored as the simulator scores it:
    the live view's ``Device`` (from the scorer's row and the announce) and the simulator's
    agree on everything both read from them, the speed's unit (GFLOP/s) among it."""
    devices = build(load_fleet({"seed": 3, "devices": {"laptop": 1, "workstation": 1}}))
    simulation = ServingSimulation(devices, make_policy("dwps"), model=MODEL)
    weights_gb = HYPOTHETICAL_MODELS[MODEL].weights_gb
    rng = np.random.default_rng(0)
    for emulated, simulated in zip(devices, simulation.fleet.devices, strict=True):
        announce = emulated.announce(0.0, interval_s=1.0)
        sample = emulated.sample(0, 0.0, rng)
        scores = dict(zip(SCORE_FIELDS[:5], device_scores(emulated, weights_gb), strict=True))
        row = DeviceRow(
            device_id=emulated.device_id,
            device_class=emulated.device_class,
            sample=sample,
            total=0.5,
            **scores,
        )
        live = to_device(row, announce, load=0.0, reserved_gb=0.0)
        shared = (
            "device_class",
            "capability",
            "power_max_w",
            "power_now_w",
            "power_idle_w",
            "temperature_c",
            "thermal_limit_c",
            "delta_t_c",
            "speed",
            "memory_gbps",
            "battery_percent",
            "plugged",
        )
        assert {f: getattr(live, f) for f in shared} == {f: getattr(simulated, f) for f in shared}
        assert live.speed == emulated.capabilities.fp32_tflops * 1000.0  # GFLOP/s
        assert live.memory_gbps == emulated.capabilities.memory_bandwidth_gbps > 0


def test_a_device_that_announced_its_vram_offers_it_apart_from_host_memory() -> None:
    """A CUDA llama.cpp worker announces the GPU memory it offloads layers to; the view offers
    that less what is in use on the GPU (another program's), or, once deployments hold some of
    it, less what they hold; a device that announced none offers none, whatever its GPU."""
    from libs.contracts.device import GpuSample

    gpu = GpuSample(
        utilisation=0.0, memory_used_gb=2.0, memory_total_gb=24.0, power_w=60.0, temperature_c=40.0
    )
    sample = make_telemetry("host-a", memory_total_gb=32.0, memory_available_gb=30.0, gpu=gpu)
    row = DeviceRow(device_id="host-a", sample=sample, total=0.5, compute=0.5)
    caps = make_capabilities()
    announce = DeviceAnnounce(
        device_id="host-a",
        device_class=DeviceClass.WORKSTATION,
        capabilities=caps,
        emulated=False,
        vram_gb=19.2,  # 80 % of the 24 GB
        ts=NOW,
    )
    free = to_device(row, announce, load=0.0, reserved_gb=0.0)
    assert free.vram_free_gb == 19.2 - 2.0 and free.memory_free_gb == 30.0
    held = to_device(row, announce, load=0.0, reserved_gb=5.0, vram_gb=12.0)
    assert held.vram_free_gb == 19.2 - 12.0 and held.memory_free_gb == 25.0
    unannounced = announce.model_copy(update={"vram_gb": None})
    assert to_device(row, unannounced, load=0.0, reserved_gb=0.0).vram_free_gb == 0.0
