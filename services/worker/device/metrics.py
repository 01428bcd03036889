"""The worker's Prometheus metrics (served on its own port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tokens = Counter("tessera_worker_tokens", "Tokens sampled on this worker", registry=r)
        self.refused = Counter(
            "tessera_worker_refused_requests", "Requests refused: too many in flight", registry=r
        )
        self.rejected = Counter(
            "tessera_worker_rejected_messages",
            "Messages and frames that broke their contract, by channel and reason",
            ["channel", "reason"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "tessera_worker_step_seconds",
            "Compute time of one shard step",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.queue_depth = Gauge(
            "tessera_worker_queue_depth", "Steps waiting to run or parked", registry=r
        )
        self.active = Gauge("tessera_worker_active_requests", "Requests in flight", registry=r)
        self.gpu_power = Gauge("tessera_worker_gpu_power_watts", "GPU power (NVML)", registry=r)
        self.gpu_temperature = Gauge(
            "tessera_worker_gpu_temperature_celsius", "GPU temperature (NVML)", registry=r
        )
        self.gpu_memory = Gauge(
            "tessera_worker_gpu_memory_used_bytes", "GPU memory in use (NVML)", registry=r
        )
