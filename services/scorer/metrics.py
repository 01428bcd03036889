"""The scorer's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram


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
