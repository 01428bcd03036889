"""`tessera up` starts the cluster, says ready, serves /healthz, registers SmolLM2 with its file
in the cluster's object store, and cleans up after itself; a model not registered is refused
(by `tessera up` and `tessera deploy`, naming the registered ones), is not listed by
/v1/models, and leaves every device's power and load as they were."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libs.cluster import runfile
from libs.models.shipped import shipped_card
from libs.runtime.nats_client import close_nats, connect_nats
from libs.weights.object_store import stored
from tests.e2e.cluster import RunningCluster, alive, descendants


@pytest.fixture
def cluster() -> Iterator[RunningCluster]:
    running = RunningCluster()
    yield running
    running.stop()


async def shipped_weights_stored(run_file: Path) -> bool:
    """Whether the running cluster's object store holds the shipped model's file."""
    running = runfile.read(run_file)
    ca = running.get("nats_ca")
    nc = await connect_nats(running["nats_url"], "test", ca_file=Path(ca) if ca else None)
    try:
        return await stored(nc, shipped_card().sha256) is not None
    finally:
        await close_nats(nc)


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
    assert asyncio.run(shipped_weights_stored(cluster.run_file))  # for workers on other hosts

    children = descendants(cluster.process.pid)
    assert len(children) >= 3  # nats-server, redis-server and at least the gateway
    assert cluster.interrupt(90) == 0  # a bound, not a goal: this machine is shared
    assert [pid for pid in children if alive(pid)] == []


def test_with_restart_no_a_service_that_dies_is_reported_and_brings_the_cluster_down() -> None:
    """``--restart no``: nothing is started again (``test_supervision.py``: the default)."""
    cluster = RunningCluster("--restart", "no")
    try:
        dies_and_takes_the_cluster_down(cluster)
    finally:
        cluster.stop()


def dies_and_takes_the_cluster_down(cluster: RunningCluster) -> None:
    cluster.wait_for("ready:")
    children = descendants(cluster.process.pid)
    gateway = next(
        pid for pid in children if b"services.gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    os.kill(gateway, signal.SIGKILL)
    cluster.wait_for("gateway stopped by SIGKILL unexpectedly", timeout_s=10)
    assert cluster.exit_code(90) == 1
    assert [pid for pid in children if alive(pid)] == []


MODEL = "smollm2-135m-instruct"
#: Not in the registry: refused at once, naming the models there are.
UNSERVED = "llama-3.2-1b-instruct"


@pytest.fixture(scope="module")
def refusing() -> Iterator[RunningCluster]:
    """`tessera up` deploying the shipped model and one no worker can serve."""
    running = RunningCluster("--deploy", MODEL, "--deploy", UNSERVED)
    running.wait_for("ready:", 300)
    yield running
    running.stop()


Reading = tuple[int, int, float, float, float]


def readings(cluster: RunningCluster) -> dict[str, Reading]:
    """Each device's last sample as the cluster reports it: (seq, running tasks, load, W,
    clock share)."""
    rows = httpx.get(f"{cluster.base_url}/v1/cluster/devices", timeout=5).json()
    return {
        r["device_id"]: (
            s["seq"],
            s["running_tasks"],
            s["cpu_utilisation"],
            s["power_w"],
            s["frequency_scale"],
        )
        for r in rows
        if (s := r.get("sample"))
    }


def fresh_readings(cluster: RunningCluster, after: dict[str, Reading]) -> dict[str, Reading]:
    """Readings two samples newer than ``after`` for every device."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = readings(cluster)
        if all(d in now and now[d][0] >= seq + 2 for d, (seq, *_) in after.items()):
            return now
        time.sleep(0.2)
    raise AssertionError("no fresh samples within 60 s")


def test_a_model_no_worker_can_serve_is_refused_not_listed_and_leaves_the_devices_be(
    refusing: RunningCluster,
) -> None:
    [said] = [line for line in refusing.lines if f"could not deploy {UNSERVED}" in line]
    assert "unknown model" in said and MODEL in said, said  # the registered ones named
    assert any(f"deployed {MODEL} on" in line for line in refusing.lines)
    base = refusing.base_url
    before = fresh_readings(refusing, readings(refusing))
    assert {"worker-0", "worker-1"} <= set(before)

    env = {**os.environ, "TESSERA_RUN_FILE": str(refusing.run_file), "COLUMNS": "200"}
    deploy = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", "deploy", UNSERVED, "--id", "again"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = " ".join((deploy.stdout + deploy.stderr).split())
    assert deploy.returncode == 1, out
    assert "unknown model" in out and "tessera models add" in out, out

    models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    after = fresh_readings(refusing, before)
    for device, (_, tasks, load, watts, clock) in before.items():
        _, tasks_now, load_now, watts_now, clock_now = after[device]
        assert tasks_now == tasks, device
        if clock_now == clock:  # the scheduler's clock hints move load and power; not this
            assert load_now == load, device
            assert watts_now <= watts + 1e-6, device  # as it was, or asleep since

    # A model a worker can serve: followed until it serves, then listed.
    second = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", "deploy", MODEL, "--id", "second"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = " ".join(second.stdout.split())
    assert second.returncode == 0, out + second.stderr
    assert "second serving on" in out, out
    models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [MODEL]  # by name, once: ids are an admin detail
