"""Two `tessera up` on one machine, each on its own home: each finds free ports for what was
not given, the second keeps its own run file, and both reach ready and answer. A third on the
first's home is refused, naming the first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from libs.runtime.procs import ServiceProcess


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
        again = subprocess.run(
            [sys.executable, *argv],
            env={**os.environ, **env, "TESSERA_HOME": homes[0]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        said = " ".join((again.stdout + again.stderr).split())
        assert again.returncode == 2, said
        assert f"another `tessera up` (pid {first.process.pid}) runs on {homes[0]}" in said, said
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
        assert json.loads(run_file.read_text())["gateway_url"] == urls[0]
        [own] = [p for p in run_file.parent.glob("cluster-*.json")]
        assert json.loads(own.read_text())["gateway_url"] == urls[1]
        assert any(str(own) in str(e.get("msg", "")) for e in second.lines)
    finally:
        second.stop(timeout_s=30)
        first.stop(timeout_s=30)
