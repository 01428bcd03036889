"""This host as a device: power from RAPL or a discharging battery, else unknown (never a
guess); a memory cap limits what shards may take while the host's own memory is announced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil

from libs.devices.calibration import Calibration
from libs.devices.host_device import GB, HostDevice, HostProbe, PowerMeter, discharge_w

CALIBRATION = Calibration(
    fp32_gflops=50.0, int8_gops=100.0, memory_bandwidth_gbps=10.0, seconds=1.0, host="test"
)


def battery(root: Path, status: str, **files: int) -> Path:
    folder = root / "BAT0"
    folder.mkdir(parents=True)
    (folder / "status").write_text(status + "\n")
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    return root


def test_a_host_without_rapl_or_battery_reports_its_power_as_unknown(tmp_path: Path) -> None:
    probe = HostProbe(rapl=tmp_path / "powercap", supplies=tmp_path / "power_supply")
    assert probe.read().power_w is None
    assert probe.power_source().startswith("unknown")


def test_a_discharging_battery_gives_what_it_delivers_and_a_charging_one_nothing(
    tmp_path: Path,
) -> None:
    assert discharge_w(battery(tmp_path / "a", "Discharging", power_now=12_500_000)) == 12.5
    volts_amps = battery(
        tmp_path / "b", "Discharging", current_now=2_000_000, voltage_now=11_000_000
    )
    assert discharge_w(volts_amps) == 22.0
    assert discharge_w(battery(tmp_path / "c", "Charging", power_now=30_000_000)) is None
    probe = HostProbe(rapl=tmp_path / "none", supplies=tmp_path / "a")
    assert probe.read().power_w == 12.5


def test_rapl_counters_give_watts_from_the_second_reading_on(tmp_path: Path) -> None:
    counter = tmp_path / "intel-rapl:0" / "energy_uj"
    counter.parent.mkdir()
    counter.write_text("1000000\n")
    meter = PowerMeter(tmp_path)
    assert meter.measures and meter.watts() is None  # one reading is no rate
    counter.write_text("3000000\n")  # 2 J later
    watts = meter.watts()
    assert watts is not None and watts > 0


def test_a_capped_host_announces_its_own_memory_and_offers_only_the_cap() -> None:
    device = HostDevice.probe("host-test", CALIBRATION, memory_gb=0.5)
    total = psutil.virtual_memory().total / GB
    announced = device.announce(0.0, 1.0)
    assert not announced.emulated
    assert abs(announced.capabilities.memory_total_gb - total) < 0.01
    assert device.memory_limit_gb == 0.5
    sample = device.sample(1, 0.0, np.random.default_rng(0))
    assert abs(sample.memory_total_gb - total) < 0.01 and sample.memory_available_gb <= 0.5
    uncapped = HostDevice.probe("host-test", CALIBRATION)
    assert uncapped.memory_limit_gb == uncapped.capabilities.memory_total_gb
