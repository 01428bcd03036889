"""Prometheus metrics for services without a web framework: /metrics on their own port."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int | None:
    """Serve ``registry`` on ``host:port`` (0 picks a free port; -1 serves nothing).

    Returns the port it listens on, or None.
    """
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    log.info("metrics", extra={"metrics_url": f"http://{host}:{bound}/metrics"})
    return bound
