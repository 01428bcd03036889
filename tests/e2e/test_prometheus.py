"""A real Prometheus scrapes every service of the local cluster."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest

from libs.cluster import runfile
from libs.runtime.procs import child_kwargs, free_port, stop_process
from tests.e2e.cluster import RunningCluster


@pytest.fixture
def cluster(shared_cluster: RunningCluster) -> RunningCluster:
    """The cluster the e2e tests share (``tests/e2e/shared.py``): two workers, four devices."""
    return shared_cluster


def query(base: str, promql: str) -> list[dict[str, object]]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    return response.json()["data"]["result"]  # type: ignore[no-any-return]


def test_prometheus_scrapes_every_service_and_answers_promql(
    cluster: RunningCluster, tmp_path: object
) -> None:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is missing: run `make deps` (Debian's prometheus package)")
    config = cluster.run_file.with_name("prometheus.yml")
    services = set(runfile.read(cluster.run_file)["metrics"])
    assert services == {"scorer", "telemetry", "scheduler", "gateway", "worker-0", "worker-1"}
    port = free_port()
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={cluster.run_file.parent / 'tsdb'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **child_kwargs(),  # type: ignore[call-overload]
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        up: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            try:
                up = query(base, 'up{job="tessera"} == 1')
                temperature = query(base, "tessera_device_temperature_celsius")
                decisions = query(base, "tessera_scheduler_decision_seconds_bucket")
                if len(up) == len(services) and temperature and decisions:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert {s["metric"]["service"] for s in up} == services  # type: ignore[index]
        assert float(temperature[0]["value"][1]) > 0  # type: ignore[index]
        assert {s["metric"]["le"] for s in decisions} >= {"0.0001", "+Inf"}  # type: ignore[index]
        rules = httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert (
            sum(len(g["rules"]) for g in rules) == 13
        )  # deploy/prometheus/rules/tessera.yml: 11, and the two of restarts
    finally:
        stop_process(prometheus)
