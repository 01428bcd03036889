"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.cluster.servers import NatsServer, RedisServer
from tests.processes import ServiceProcess, service_env


@pytest.fixture
def scorer(
    nats_server: NatsServer, redis_server: RedisServer, uid: str
) -> Iterator[ServiceProcess]:
    """A scorer process on the test's servers, its keys under ``uid``; it must stop cleanly."""
    process = ServiceProcess("scorer", service_env(nats_server, redis_server, uid)).start()
    yield process
    assert process.stop() == 0
