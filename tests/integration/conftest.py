"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cluster.servers import NatsServer, RedisServer
from tests.certificates import write_certificates
from tests.processes import ServiceProcess, service_env


@pytest.fixture
def scorer(
    nats_server: NatsServer, redis_server: RedisServer, uid: str
) -> Iterator[ServiceProcess]:
    """A scorer process on the test's servers, its keys under ``uid``; it must stop cleanly."""
    process = ServiceProcess("scorer", service_env(nats_server, redis_server, uid)).start()
    yield process
    assert process.stop() == 0, process.tail()


@pytest.fixture(scope="session")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA (``ca``) and a certificate for 127.0.0.1 it signed (``cert``, ``key``)."""
    return write_certificates(tmp_path_factory.mktemp("tls"), "127.0.0.1", "localhost")
