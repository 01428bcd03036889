"""The scorer's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.scorer.table import DeviceRecord

DIMENSIONS = ("compute", "memory", "efficiency", "network", "stability", "total")


@dataclass
class ScorerMetrics:
    registry: CollectorRegistry
    samples: Counter
    rejected: Counter
    failures: Counter
    recoveries: Counter
    flush_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ScorerMetrics:
        reg = registry or CollectorRegistry()
        return cls(
            reg,
            Counter("tessera_telemetry_samples", "Telemetry samples ingested", registry=reg),
            Counter(
                "tessera_telemetry_rejected",
                "Messages rejected, by channel and reason",
                ["channel", "reason"],
                registry=reg,
            ),
            Counter("tessera_device_failures", "Devices declared failed", registry=reg),
            Counter("tessera_device_recoveries", "Failed devices heard from again", registry=reg),
            Histogram(
                "tessera_scorer_flush_seconds",
                "Time of one scorer flush",
                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                registry=reg,
            ),
        )


class DeviceCollector(Collector):
    """Per-device gauges read from the scorer's table at scrape time, so ingesting a sample
    costs nothing extra. Labels: device_id and device_class (bounded by the fleet)."""

    def __init__(self, records: Callable[[], Iterable[DeviceRecord]]) -> None:
        self.records = records

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["device_id", "device_class"]
        up = GaugeMetricFamily(
            "tessera_device_up", "1 while heartbeating, 0 once failed", labels=labels
        )
        temperature = GaugeMetricFamily(
            "tessera_device_temperature_celsius", "Temperature", labels=labels
        )
        limit = GaugeMetricFamily(
            "tessera_device_thermal_limit_celsius",
            "Throttle limit (85 mobile, 95 desktop)",
            labels=labels,
        )
        battery = GaugeMetricFamily(
            "tessera_device_battery_ratio", "Battery level (0-1)", labels=labels
        )
        plugged = GaugeMetricFamily(
            "tessera_device_plugged", "1 when on mains power", labels=labels
        )
        power = GaugeMetricFamily("tessera_device_power_watts", "Power draw", labels=labels)
        budget = GaugeMetricFamily(
            "tessera_device_power_max_watts", "Power budget (max)", labels=labels
        )
        rtt = GaugeMetricFamily(
            "tessera_device_network_rtt_seconds", "Round trip to NATS", labels=labels
        )
        utilisation = GaugeMetricFamily(
            "tessera_device_utilisation_ratio", "Busy share", labels=labels
        )
        speed_scale = GaugeMetricFamily(
            "tessera_device_speed_scale",
            "What the announced speed is scaled by to match the measured (1: honest)",
            labels=labels,
        )
        score = GaugeMetricFamily(
            "tessera_device_score", "Capability score by dimension", labels=[*labels, "dimension"]
        )
        for r in self.records():
            key = [r.device_id, r.device_class.value]
            up.add_metric(key, 0.0 if r.failed else 1.0)
            limit.add_metric(key, r.thermal_limit_c)
            budget.add_metric(key, r.max_power_w)
            speed_scale.add_metric(key, r.speed_scale)
            s = r.latest
            if s is not None:
                if s.temperature_c is not None:  # unknown: no series, not a made-up value
                    temperature.add_metric(key, s.temperature_c)
                if s.power_w is not None:
                    power.add_metric(key, s.power_w)
                rtt.add_metric(key, s.network_rtt_ms / 1000.0)
                utilisation.add_metric(key, s.cpu_utilisation)
                if s.battery_percent is not None:
                    battery.add_metric(key, s.battery_percent / 100.0)
                    plugged.add_metric(key, 1.0 if s.plugged else 0.0)
            for dimension, value in (r.scores or {}).items():
                score.add_metric([*key, dimension], value)
        yield from (
            up,
            temperature,
            limit,
            battery,
            plugged,
            power,
            budget,
            rtt,
            utilisation,
            speed_scale,
            score,
        )
