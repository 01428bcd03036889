"""The scheduler's view of a device that reports no temperature or power: its heat model
starts from a room's, its power is modelled from its load, and the cluster's tokens/J counts
only devices that measure their power."""

from __future__ import annotations

from libs.contracts import DeviceAnnounce, DeviceClass
from libs.contracts.keys import DeviceRow
from libs.core.energy import cluster_rates
from services.scheduler.view import IDLE_SHARE, ROOM_C, to_device
from tests.builders import NOW, make_capabilities, make_telemetry


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
