"""The scorer's in-memory view of each device: what it announced, when it was last heard,
what was last scored, and its stability history. Pure: no I/O."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from libs.contracts import Capabilities, DeviceAnnounce, DeviceClass, TelemetrySample
from libs.core.capability import MEMORY_TYPE_SCORE, compute_index
from libs.core.honesty import SAMPLES, device_ratio, speed_scales
from services.scorer.settings import ScorerSettings


@dataclass
class History:
    first_seen: float
    down_s: float = 0.0
    failures: int = 0
    down_since: float | None = None


@dataclass
class DeviceRecord:
    device_id: str
    device_class: DeviceClass
    interval_s: float
    claimed: Capabilities
    model_type: str
    compute: float  # CCI of the claims times ``speed_scale``
    memory_type_score: float
    typical_power_w: float
    max_power_w: float
    thermal_limit_c: float
    history: History
    last_seen: float
    #: The ``ts`` of the announce this record is built from (sent with its scores).
    announced_ts: float
    failed: bool = False
    #: When the device counts as failed if nothing is heard before (see ``touch``).
    deadline: float = float("inf")
    #: It said it leaves: failed at once, and not revived by what it still sends (an
    #: announce makes a new record: it joined again).
    leaving: bool = False
    last_scored_at: float | None = None
    last_scored: TelemetrySample | None = None
    scores: dict[str, float] | None = None
    latest: TelemetrySample | None = field(default=None, repr=False)
    #: The device's last measurements of its own speed (GFLOP/s), and what its claims are
    #: scaled by when they overstate it (``libs/core/honesty.py``).
    measured: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    speed_scale: float = 1.0

    @classmethod
    def from_announce(
        cls, announce: DeviceAnnounce, history: History, now: float, model_type: str
    ) -> DeviceRecord:
        caps = announce.capabilities
        return cls(
            device_id=announce.device_id,
            device_class=announce.device_class,
            interval_s=announce.interval_s,
            claimed=caps,
            model_type=model_type,
            compute=claimed_compute(caps, 1.0, model_type),
            memory_type_score=MEMORY_TYPE_SCORE[caps.memory_type],
            typical_power_w=caps.typical_power_w,
            max_power_w=caps.max_power_w,
            thermal_limit_c=caps.thermal_limit_c,
            history=history,
            last_seen=now,
            announced_ts=announce.ts,
        )

    def rescale(self, scale: float) -> None:
        """Scale the claimed speed (compute, INT8 and bandwidth alike) by ``scale``."""
        self.speed_scale = scale
        self.compute = claimed_compute(self.claimed, scale, self.model_type)

    def leave(self) -> None:
        """The next detector pass declares it failed, so its work moves while it serves."""
        self.leaving, self.deadline = True, 0.0

    def touch(self, now: float, misses: int) -> None:
        """Heard from at ``now``: it fails if silent for ``misses`` intervals (+ a grace)."""
        if self.leaving:
            return
        self.last_seen = max(self.last_seen, now)
        grace = min(1.0, 0.25 * self.interval_s)
        self.deadline = self.last_seen + misses * self.interval_s + grace


def check_speeds(table: dict[str, DeviceRecord]) -> list[DeviceRecord]:
    """Scale the claims of devices that measure far below what they announced; the records
    whose scale changed (by more than 5 %), to re-score now."""
    ratios = {}
    for device_id, record in table.items():
        ratio = device_ratio(record.measured, record.claimed.fp32_tflops)
        if ratio is not None:
            ratios[device_id] = ratio
    changed = []
    for device_id, scale in speed_scales(ratios).items():
        record = table[device_id]
        if abs(scale - record.speed_scale) <= 0.05 * record.speed_scale:
            continue
        record.rescale(scale)
        changed.append(record)
    return changed


def claimed_compute(caps: Capabilities, scale: float, model_type: str) -> float:
    """CCI of the announced figures, each times ``scale``."""
    return float(
        compute_index(
            caps.fp32_tflops * scale,
            caps.int8_tops * scale,
            caps.memory_bandwidth_gbps * scale,
            model_type,
        )
    )


def significant(old: TelemetrySample | None, new: TelemetrySample, s: ScorerSettings) -> bool:
    """Whether ``new`` differs enough from what was last scored to re-score at once."""
    if old is None:
        return True
    if abs(new.memory_available_gb - old.memory_available_gb) > s.memory_change * max(
        old.memory_available_gb, 0.1
    ):
        return True
    if (new.temperature_c is None) != (old.temperature_c is None):
        return True
    heats = (new.temperature_c or 0.0, old.temperature_c or 0.0)  # both known, or both not
    if abs(heats[0] - heats[1]) > s.temperature_change_c:
        return True
    if abs(new.cpu_utilisation - old.cpu_utilisation) > s.utilisation_change:
        return True
    if abs(new.network_rtt_ms - old.network_rtt_ms) > s.rtt_change * max(old.network_rtt_ms, 1.0):
        return True
    if new.battery_percent is not None and old.battery_percent is not None:
        return abs(new.battery_percent - old.battery_percent) > s.battery_change_points
    return new.battery_percent != old.battery_percent
