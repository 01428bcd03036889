"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class SchedulerMetrics:
    registry: CollectorRegistry
    decision_seconds: Histogram
    assignments: Counter
    rejections: Counter
    migrations: Counter
    mode: Gauge
    checkpoint_timestamp: Gauge
    checkpoint_interval: Gauge
    cycle: Gauge
    queue: Gauge
    leader: Gauge
    cluster_tokens_per_second: Gauge
    cluster_tokens_per_joule: Gauge
    weights: Gauge
    match_score: Histogram

    @classmethod
    def create(cls) -> SchedulerMetrics:
        reg = CollectorRegistry()
        return cls(
            reg,
            Histogram(
                "tessera_scheduler_decision_seconds",
                "Time to decide one placement",
                buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.02, 0.1, 0.5),
                registry=reg,
            ),
            Counter(
                "tessera_scheduler_assignments",
                "Placements made",
                ["policy", "device_class"],
                registry=reg,
            ),
            Counter("tessera_scheduler_rejections", "Tasks not placed", ["reason"], registry=reg),
            Counter(
                "tessera_scheduler_migrations",
                "Shards and tasks moved off failed devices",
                registry=reg,
            ),
            Gauge(
                "tessera_scheduler_mode",
                "Active mode (1 for the active one)",
                ["mode"],
                registry=reg,
            ),
            Gauge(
                "tessera_scheduler_checkpoint_timestamp_seconds",
                "Unix time of the last saved checkpoint",
                registry=reg,
            ),
            Gauge(
                "tessera_scheduler_checkpoint_interval_seconds", "Checkpoint period", registry=reg
            ),
            Gauge("tessera_scheduler_cycle_seconds", "Decision cycle", registry=reg),
            Gauge("tessera_scheduler_queue_length", "Requests waiting for a cycle", registry=reg),
            Gauge("tessera_scheduler_leader", "1 on the replica that leads", registry=reg),
            Gauge("tessera_cluster_tokens_per_second", "Measured cluster throughput", registry=reg),
            Gauge("tessera_cluster_tokens_per_joule", "Measured cluster efficiency", registry=reg),
            Gauge("tessera_scheduler_weight", "Active profile weights", ["name"], registry=reg),
            Histogram(
                "tessera_scheduler_match_score",
                "Priority P of placed tasks",
                buckets=(0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
                registry=reg,
            ),
        )
