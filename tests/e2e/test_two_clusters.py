"""Two `tessera up` on one machine, each on its own home: each finds free ports for what was
not given, the second keeps its own run file, and both reach ready and answer. A third on the
first's home is refused, naming the first. The second faces the LAN (0.0.0.0): refused with no
API key, started once its home has one, which the gateway then asks for, logs by name and
refuses once revoked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from libs.cluster import runfile
from libs.runtime.procs import ServiceProcess


def tessera(env: dict[str, str], *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_two_clusters_side_by_side_both_reach_ready() -> None:
    run_file = Path(tempfile.mkdtemp()) / "cluster.json"
    argv = ["-m", "libs.cli.main", "up", "--devices", "1", "--workers", "0"]
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    env = {"TESSERA_RUN_FILE": str(run_file), "COLUMNS": "200"}
    homes = [tempfile.mkdtemp(prefix="tessera-home-") for _ in range(2)]
    first = ServiceProcess(
        "first", {**env, "TESSERA_HOME": homes[0]}, argv, ready_line=ready
    ).start(ready_timeout_s=180)
    second = ServiceProcess("second", {**env, "TESSERA_HOME": homes[1]}, argv, ready_line=ready)
    try:
        # One cluster per home: a second `tessera up` on the first's home is refused, naming it.
        code, said = tessera({**env, "TESSERA_HOME": homes[0]}, *argv[2:])
        assert code == 2, said
        assert f"another `tessera up` (pid {first.process.pid}) runs on {homes[0]}" in said, said
        # The second faces the LAN: refused with no key, started once its home has one.
        lan = {**env, "TESSERA_HOME": homes[1], "TESSERA_GATEWAY_HOST": "0.0.0.0"}
        code, said = tessera(lan, *argv[2:])
        assert code == 2 and "with no API key" in said and "--open" in said, said
        code, said = tessera(lan, "keys", "create", "phone")
        key = re.search(r"key phone: (\S+)", said)
        assert code == 0 and key, said
        second.env.update(lan)
        second.start(ready_timeout_s=180)
        urls = []
        for cluster in (first, second):
            line = next(str(e["msg"]) for e in cluster.lines if ready(e))
            found = re.search(r"gateway (http://\S+) ", line)
            assert found, line
            urls.append(found.group(1))
        assert urls[0] != urls[1]
        for url in urls:
            assert httpx.get(f"{url}/healthz", timeout=10).json()["status"] == "ok"
        # The first cluster's run file is still the first's; the second wrote its own.
        assert runfile.read(run_file)["gateway_url"] == urls[0]
        [own] = [p for p in run_file.parent.glob("cluster-*.json")]
        assert runfile.read(own)["gateway_url"] == urls[1]
        assert any(str(own) in str(e.get("msg", "")) for e in second.lines)
        assert httpx.get(f"{urls[1]}/v1/models", timeout=10).status_code == 401
        # The dashboard's page is served, asking for the key; none of its data without it.
        page = httpx.get(f"{urls[1]}/", timeout=10)
        assert page.status_code == 200 and 'id="key"' in page.text, page.text[:200]
        assert httpx.get(f"{urls[1]}/v1/cluster/devices", timeout=10).status_code == 401
        auth = {"authorization": f"Bearer {key.group(1)}"}
        assert httpx.get(f"{urls[1]}/v1/models", headers=auth, timeout=10).status_code == 200
        # The access log is written once the answer is sent: read until both are in it.
        access_log, wanted = Path(homes[1]) / "logs/access.log", {("-", 401), ("phone", 200)}
        deadline = time.monotonic() + 30
        while True:
            logged = [json.loads(line) for line in access_log.open() if line.endswith("\n")]
            seen = {(e["key"], e["status"]) for e in logged}
            if seen >= wanted or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen >= wanted, seen
        assert key.group(1) not in (Path(homes[1]) / "logs/access.log").read_text()
        assert tessera(lan, "keys", "revoke", "phone")[0] == 0
        deadline = time.monotonic() + 5  # the gateway reads its keys again within a second
        while httpx.get(f"{urls[1]}/v1/models", headers=auth, timeout=10).status_code != 401:
            assert time.monotonic() < deadline, "a revoked key is still let in"
            time.sleep(0.2)
    finally:
        second.stop(timeout_s=30)
        first.stop(timeout_s=30)
