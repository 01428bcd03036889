"""Tessera services as real subprocesses (``libs.runtime.procs.ServiceProcess``, as `tessera up`
starts them) on the tests' own servers."""

from __future__ import annotations

import signal

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.procs import ServiceProcess

__all__ = ["GATEWAY_STOPPED", "TELEMETRY_INTERVAL_S", "ServiceProcess", "service_env"]

#: How a gateway exits on SIGTERM: uvicorn shuts down gracefully, then raises the signal again.
GATEWAY_STOPPED = (0, -signal.SIGTERM)

#: How often the telemetry agents of these tests report (s).
TELEMETRY_INTERVAL_S = 1.0


def service_env(nats: NatsServer, redis: RedisServer, prefix: str, **extra: str) -> dict[str, str]:
    """A service's environment on these servers, its Redis keys under ``prefix``."""
    return {
        "TESSERA_NATS_URL": nats.url,
        "TESSERA_REDIS_URL": redis.url,
        "TESSERA_KEY_PREFIX": prefix,
        "TESSERA_TELEMETRY_INTERVAL_S": str(TELEMETRY_INTERVAL_S),
        **extra,
    }
