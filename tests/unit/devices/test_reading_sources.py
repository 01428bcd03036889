"""Every device says where each of its readings comes from (``DeviceAnnounce.sources``): an
emulated device's are its class's; a worker's speed is the host's measurement scaled by its
class (estimated), or, held to a CPU quota, what it measured inside it, with the memory its
cgroup enforces; the host itself measures all of them but the power where nothing meters
it."""

from __future__ import annotations

import numpy as np

from libs.contracts import DeviceClass
from libs.devices.calibration import Calibration
from libs.devices.emulated import EmulatedDevice
from libs.devices.host_device import HostDevice
from services.worker.__main__ import make_device
from services.worker.settings import WorkerSettings

HOST = Calibration(100.0, 50.0, 20.0, 1.0, "here")
EVERY = {"speed", "memory", "power", "temperature", "network"}


def sources(device: EmulatedDevice) -> dict[str, str]:
    return dict(device.announce(0.0, 1.0).sources)


def test_an_emulated_device_says_every_reading_is_its_class_s() -> None:
    device = EmulatedDevice.draw("phone-0", DeviceClass.PHONE, np.random.default_rng(0), 0.0)
    assert sources(device) == dict.fromkeys(EVERY, "emulated")


def test_a_worker_s_speed_is_estimated_from_the_host_s_unless_held_to_a_quota() -> None:
    plain = WorkerSettings(device_id="w-0", engine="llamacpp", memory_gb=2.0)
    said = sources(make_device(plain, 0.0, HOST))
    assert said["speed"] == "estimated" and said["memory"] == "emulated", said
    held = WorkerSettings(device_id="w-1", engine="llamacpp", memory_gb=2.0, cpus=0.25)
    device = make_device(held, 0.0, HOST)
    said = sources(device)
    assert said["speed"] == "measured" and said["memory"] == "enforced", said
    assert said["power"] == said["temperature"] == "emulated", said
    # the quota is the slowdown: the measured speed is announced as measured, no class factor
    assert device.capabilities.fp32_tflops == HOST.fp32_gflops / 1000.0
    assert device.capabilities.memory_total_gb == 2.0


def test_the_host_measures_its_readings_and_says_where_power_is_estimated() -> None:
    device = HostDevice.probe("host-a", HOST)
    said = sources(device)
    metered = device.host.meter.measures
    assert said == dict.fromkeys(EVERY, "measured") | ({} if metered else {"power": "estimated"})
