"""`tessera up` starts the cluster, says ready, serves /healthz, and cleans up after itself."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import RunningCluster, alive, descendants


@pytest.fixture
def cluster() -> Iterator[RunningCluster]:
    running = RunningCluster()
    yield running
    running.stop()


def test_up_reaches_ready_serves_healthz_and_ctrl_c_leaves_no_child(
    cluster: RunningCluster,
) -> None:
    ready = cluster.wait_for("ready:")
    assert f"http://127.0.0.1:{cluster.port}" in ready
    response = httpx.get(f"{cluster.base_url}/healthz", timeout=5)
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "nats": True, "redis": True}
    httpx.get(f"{cluster.base_url}/no/such/page/123", timeout=5)
    metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=5).text
    assert 'tessera_gateway_requests_total{route="/healthz",status="200"}' in metrics
    assert 'tessera_gateway_requests_total{route="unmatched",status="404"} 1.0' in metrics

    children = descendants(cluster.process.pid)
    assert len(children) >= 3  # nats-server, redis-server and at least the gateway
    cluster.process.send_signal(signal.SIGINT)
    assert cluster.process.wait(30) == 0
    assert [pid for pid in children if alive(pid)] == []


def test_a_service_that_dies_is_reported_and_brings_the_cluster_down(
    cluster: RunningCluster,
) -> None:
    cluster.wait_for("ready:")
    children = descendants(cluster.process.pid)
    gateway = next(
        pid for pid in children if b"services.gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    os.kill(gateway, signal.SIGKILL)
    cluster.wait_for("gateway stopped by SIGKILL unexpectedly", timeout_s=10)
    assert cluster.process.wait(30) == 1
    assert [pid for pid in children if alive(pid)] == []
