"""`tessera up --fleet FILE` with workers the kernel holds to their devices' size
(``libs/cluster/enforced.py``): each worker process runs in a cgroup of its own with its CPU
quota and memory limit, announces the memory the file gives it and the speed it measured
inside its quota (a quarter-core device a quarter of a one-core one's); a worker with a link
runs in a network namespace of its own and reports the round trip it measures across it (at
least what the link adds) and the link's bandwidth; the cluster serves through them; the groups
and the link are gone once it stops. Skipped, saying why, where the kernel cannot enforce
limits."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from libs.cluster import links
from libs.cluster.limits import ROOT, unavailable
from libs.runtime.proc_tree import process_with_env
from tests.e2e.cluster import RunningCluster

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no cgroup limits: {WHY_NOT}"),
    pytest.mark.skipif(links.unavailable() is not None, reason=f"no links: {links.unavailable()}"),
    pytest.mark.timeout(400),
]
WORKERS = [
    {"id": "big", "class": "workstation", "cpus": 1.0, "memory_gb": 2},
    {
        "id": "small",
        "class": "edge_server",
        "cpus": 0.25,
        "memory_gb": 1,
        "link": {"rtt_ms": 15, "mbit": 40},
    },
    # SmolLM2 at the default context needs more than its 0.5 GB limit leaves beside the
    # worker itself: the placement refuses it there, and the worker lives on.
    {"id": "tiny", "class": "phone", "cpus": 0.25, "memory_gb": 0.5},
]


def measured_deployment(base_url: str, timeout_s: float) -> dict[str, Any]:
    """SmolLM2's deployment once what its requests measured is recorded beside it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        placed = httpx.get(f"{base_url}/v1/cluster/placements", timeout=5).json()
        found = [d for d in placed if d["model"] == "smollm2-135m-instruct" and d["measured"]]
        if found:
            return found[0]  # type: ignore[no-any-return]
        time.sleep(0.5)
    raise AssertionError(f"nothing measured within {timeout_s} s: {placed}")


def serving_within(base_url: str, deployment_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{base_url}/v1/cluster/placements/{deployment_id}", timeout=5).json()
        if status["phase"] == "serving":
            return
        assert status["phase"] not in ("refused", "failed"), status["reason"]
        time.sleep(0.5)
    raise AssertionError(f"{deployment_id} not serving within {timeout_s} s: {status}")


def groups_of(name: str) -> list[Path]:
    """The cgroup folders made for worker ``name`` (one per controller; v2: one)."""
    return sorted(ROOT.rglob(f"tessera-*-{name}"))


@pytest.mark.alone  # compares two measured speeds: nothing may run beside it
def test_workers_run_held_to_their_devices_size_and_announce_what_they_measure(
    tmp_path: Path,
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"workers": WORKERS}))
    cluster = RunningCluster("--fleet", str(fleet))
    try:
        cluster.wait_for("ready:", 300)
        said = "\n".join(cluster.lines)
        assert "fleet: small (edge_server) held to 0.25 cores and 1 GB" in said, said
        rows = httpx.get(f"{cluster.base_url}/v1/cluster/devices", timeout=5).json()
        caps = {r["device_id"]: r["capabilities"] for r in rows if r["capabilities"]}
        assert {"big", "small"} <= set(caps), sorted(caps)
        assert (caps["big"]["memory_total_gb"], caps["small"]["memory_total_gb"]) == (2, 1)
        ratio = caps["small"]["fp32_tflops"] / caps["big"]["fp32_tflops"]
        print(f"announced fp32 small ÷ big: {ratio:.3f}")
        # Each calibrates while the cluster's other processes start beside it (0.207 seen;
        # 0.110 in a fresh-clone run on a day this machine ran at half speed): the quota's own
        # 0.2–0.3 is tests/integration/test_limits.py's, on a quiet machine. Unheld, the small
        # one would measure what the big one does.
        assert 0.08 <= ratio <= 0.35, caps
        sources = {r["device_id"]: r["sources"] for r in rows}
        assert sources["small"]["speed"] == "measured", sources
        assert sources["small"]["memory"] == "enforced", sources
        assert sources["small"]["power"] == "emulated", sources
        assert sources["small"]["network"] == "measured", sources
        assert sources["big"]["network"] == "emulated", sources
        assert "fleet: small on a link of 40 Mbit/s each way, 15 ms added" in said, said
        samples = {r["device_id"]: r["sample"] for r in rows}
        rtt = samples["small"]["network_rtt_ms"]
        print(f"small's measured round trip over its 15 ms link: {rtt:.1f} ms")
        assert rtt >= 15.0, samples["small"]
        bandwidth = caps["small"]["network_bandwidth_mbps"]
        print(f"small's measured bandwidth over its 40 Mbit/s link: {bandwidth} Mbit/s")
        assert 0 < bandwidth <= 40 * 1.1, caps["small"]  # measured: no more than tc lets through
        pid = process_with_env(cluster.process.pid, "TESSERA_WORKER_DEVICE_ID", "small")
        assert pid is not None
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        for name in ("big", "small"):  # its process is inside its groups
            pid = process_with_env(cluster.process.pid, "TESSERA_WORKER_DEVICE_ID", name)
            assert pid is not None
            folders = groups_of(name)
            assert folders, f"no cgroup for {name}"
            for folder in folders:
                assert str(pid) in (folder / "cgroup.procs").read_text().split()
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="-", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
        )
        assert reply.choices[0].message.content
        shown = httpx.get(
            f"{cluster.base_url}/v1/cluster/previews",
            params={"model": "smollm2-135m-instruct"},
            timeout=30,
        ).json()
        guesses = {len(p["devices"]): p["predicted"] for p in shown if p["feasible"]}
        print(f"predicted by devices: {guesses}")
        alone = guesses[1]  # the fastest device alone, then with slower ones: predicted slower
        assert 0 < alone["tokens_per_s_1"] < alone["tokens_per_s_8"], guesses
        assert guesses[2]["tokens_per_s_1"] < alone["tokens_per_s_1"], guesses
        # Once it serves, what its requests measure sits beside the prediction, and the next
        # prediction for its devices is corrected to it.
        for i in range(4):
            client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": f"Count from {i} to {i + 30}."}],
                max_tokens=32,
            )
        deployment = measured_deployment(cluster.base_url, 30)
        route = [
            a["device_id"]
            for a in sorted(deployment["assignments"], key=lambda a: a["shard_index"])
        ]
        measured, predicted = deployment["measured"], deployment["predicted"]
        print(f"{route}: predicted {predicted}, measured {measured}")
        assert predicted["tokens_per_s_1"] > 0 and measured["tokens_per_s_1"] > 0
        assert 0 < predicted["watts_1"] <= predicted["watts_8"]  # from the draws they report
        assert measured["watts_1"] is None  # no meter here to measure them
        again = httpx.get(
            f"{cluster.base_url}/v1/cluster/previews",
            params={"model": "smollm2-135m-instruct"},
            timeout=30,
        ).json()
        [same] = [p["predicted"] for p in again if p["feasible"] and p["devices"] == route]
        print(f"predicted for {route} after the measurement: {same}")
        assert same["tokens_per_s_1"] == pytest.approx(measured["tokens_per_s_1"], rel=0.03)
        metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=5).text
        assert (
            'tessera_deployment_tokens_per_second{deployment="smollm2-135m-instruct",source="measured",streams="1"}'
            in metrics
        )
        # A split across small's link: the head's llama.cpp reaches small's RPC server through
        # the link's relay (its delay and bandwidth), over the cluster's mutual TLS.
        across = {
            "model": "smollm2-135m-instruct",
            "deployment_id": "across",
            "devices": ["big", "small"],
        }
        placed = httpx.post(f"{cluster.base_url}/v1/cluster/placements", json=across, timeout=60)
        assert placed.status_code == 201, placed.text
        serving_within(cluster.base_url, "across", 120)
        split = client.chat.completions.create(
            model="across", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4
        )
        assert split.choices[0].message.content
        pinned = {"model": "smollm2-135m-instruct", "deployment_id": "on-tiny", "devices": ["tiny"]}
        refused = httpx.post(f"{cluster.base_url}/v1/cluster/placements", json=pinned, timeout=30)
        assert refused.status_code == 409 and "memory" in refused.text, refused.text
        room = samples["tiny"]["memory_available_gb"]
        print(f"tiny: 0.5 GB limit, {room:.3f} GB of room reported; refused: {refused.text}")
        assert 0 < room < 0.5, samples["tiny"]  # the limit, less what the worker already uses
        for name, limit in (("tiny", 0.5), ("small", 1.0)):  # linked or not: read, not 80 %
            assert samples[name]["memory_available_gb"] != pytest.approx(0.8 * limit), name
        assert f"have {room:.2f} GB free" in refused.text  # the room the placement counted
        tiny = process_with_env(cluster.process.pid, "TESSERA_WORKER_DEVICE_ID", "tiny")
        assert tiny is not None  # not killed: nothing was sent to it
    finally:
        cluster.stop()
    assert groups_of("big") == groups_of("small") == groups_of("tiny") == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in namespaces.split() if n.startswith("tl")], namespaces
