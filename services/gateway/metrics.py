"""The gateway's per-request metrics: a count by route and status, and a duration that ends
with the response's last byte (a streamed completion counts to its end, not to its headers)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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
