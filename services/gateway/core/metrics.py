"""The gateway's metrics: per request, a count by route and status and a duration that ends
with the response's last byte (a streamed completion counts to its end, not to its headers);
per generation, the time to first token, between tokens, tokens served and errors; the last
minute's times to first token (the dashboard's latency chart); messages refused."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.contracts import Speed


class RequestMetrics:
    """ASGI middleware counting ``requests`` (labels: route, status) and observing
    ``duration`` (label: route), by the route template: labels stay bounded whatever paths
    clients send. The duration is observed once the application has sent its last byte, or
    failed, or its client left; a request that fails before answering counts as 500 (what
    the error handler outside answers)."""

    def __init__(self, app: ASGIApp, requests: Counter, duration: Histogram) -> None:
        self.app, self.requests, self.duration = app, requests, duration

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.requests.labels(route, str(status)).inc()
            self.duration.labels(route).observe(time.perf_counter() - started)


class Ttfts:
    """Times to first token of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.seen: deque[tuple[float, float]] = deque(maxlen=10_000)

    def add(self, seconds: float) -> None:
        self.seen.append((time.monotonic(), seconds))

    def median(self) -> float | None:
        since = time.monotonic() - self.window_s
        recent = [s for at, s in self.seen if at >= since]
        return statistics.median(recent) if recent else None


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.ttft = Histogram(
            "tessera_gateway_ttft_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tessera_gateway_inter_token_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "tessera_gateway_completion_tokens", "Completion tokens served", registry=r
        )
        self.errors = Counter(
            "tessera_gateway_generation_errors", "Generations that ended in an error", registry=r
        )
        #: The last minute's times to first token (the dashboard's latency chart).
        self.recent_ttft = Ttfts()
        self.rejected = Counter(
            "tessera_gateway_rejected_messages",
            "NATS messages that broke their contract, by channel and reason",
            ["channel", "reason"],
            registry=r,
        )

        #: What ``tessera up`` says of its services (``ServiceRestarted``): the alerts'
        #: ``TesseraServiceRestarting`` and ``TesseraServiceFailed`` read these.
        self.restarts = Counter(
            "tessera_cluster_service_restarts",
            "Services of tessera up started again after they exited, by service",
            ["service"],
            registry=r,
        )
        self.service_failed = Gauge(
            "tessera_cluster_service_failed",
            "1 while tessera up has given up on a service that kept crashing",
            ["service"],
            registry=r,
        )

        #: Each deployment's speed, predicted by the scheduler and measured here.
        self.speed = Gauge(
            "tessera_deployment_tokens_per_second",
            "A deployment's aggregate tokens/s, by requests at once, predicted and measured",
            ["deployment", "streams", "source"],
            registry=r,
        )
        self.speed_ttft = Gauge(
            "tessera_deployment_ttft_seconds",
            "A deployment's time to a first token, predicted (64 prompt tokens) and measured",
            ["deployment", "source"],
            registry=r,
        )

    def watch_batches(self, counts: Mapping[str, Callable[[], float]]) -> None:
        """The batch runner's requests sent again, by why: ``preempted`` (an interactive
        request came), ``worker_lost`` (its batch worker died mid-request), ``not_taken`` (no
        batch worker took it in time), read when scraped."""
        again = Gauge(
            "tessera_gateway_batch_requests_sent_again",
            "The batch runner's requests sent again since the gateway started, by why",
            ["why"],
            registry=self.registry,
        )
        for why, count in counts.items():
            again.labels(why).set_function(count)

    def on_speed(self, deployment: str, speeds: Mapping[str, Speed | None]) -> None:
        """``deployment``'s speeds by source (``predicted``, ``measured``)."""
        for source, speed in speeds.items():
            if speed is None:
                continue
            for streams, rate in (("1", speed.tokens_per_s_1), ("8", speed.tokens_per_s_8)):
                if rate is not None:
                    self.speed.labels(deployment, streams, source).set(rate)
            if speed.ttft_ms is not None:
                self.speed_ttft.labels(deployment, source).set(speed.ttft_ms / 1000.0)

    def on_rejected(self, channel: str, reason: str, detail: str) -> None:
        self.rejected.labels(channel, reason).inc()

    def on_restart(self, service: str, failed: bool) -> None:
        if failed:
            self.service_failed.labels(service).set(1)
        else:
            self.restarts.labels(service).inc()
            self.service_failed.labels(service).set(0)
