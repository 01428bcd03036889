"""`tessera up` supervises what it started: each service's process, killed with SIGKILL in turn
under a steady stream of chat requests, is started again by the cluster itself (nothing here
restarts anything), back within 5 s; every request completes with the same greedy text (a
client retries what it is told to retry, as OpenAI's does), none lost, none corrupt; `tessera
status` counts each restart, and the gateway's metrics count those told to the cluster.

It uses the shared cluster last (its module sorts after the others that share it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from libs.runtime.proc_tree import unit_pid
from tests.e2e import shared
from tests.e2e.cluster import RunningCluster

MODEL = "smollm2-135m-instruct"
KEY = shared.KEYS[0]
#: Each service in turn, then Redis and nats-server; a worker last (its device's shards
#: move, then it is back).
KILLED = ("scorer", "telemetry", "scheduler", "gateway", "redis", "nats", "worker-1")
#: Alone: how soon each is back is the check, with no other test taking the cores.
pytestmark = [pytest.mark.timeout(600), pytest.mark.alone]


@pytest.fixture
def cluster(shared_cluster: RunningCluster) -> RunningCluster:
    return shared_cluster


def greedy(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def test_each_service_killed_under_load_is_started_again_and_nothing_is_lost(
    cluster: RunningCluster,
) -> None:
    # OpenAI's client retries a refused connection, 429, 5xx (with backoff): 6 tries.
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY, max_retries=6)
    expected = greedy(client)
    answers: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def steady() -> None:
        while not stop.is_set():
            try:
                answers.append(greedy(client))
            except openai.OpenAIError as exc:
                errors.append(repr(exc))

    sender = threading.Thread(target=steady)
    sender.start()
    took: dict[str, float] = {}
    try:
        for name in KILLED:
            seen = len(cluster.lines)
            before = len(answers)
            os.kill(unit_pid(cluster.process.pid, name), signal.SIGKILL)
            killed = time.monotonic()
            back = cluster.wait_for(f"{name} back after", 60)
            took[name] = time.monotonic() - killed
            assert re.search(rf"{name} back after [\d.]+ s", back), back
            said = cluster.lines[seen:]
            assert any(f"{name} stopped by SIGKILL; restarting it" in line for line in said)
            deadline = time.monotonic() + 60
            while len(answers) < before + 2:  # requests go on after it is back
                assert time.monotonic() < deadline, (name, errors[-3:])
                time.sleep(0.2)
    finally:
        stop.set()
        sender.join(timeout=120)
    print(f"back after (s): {', '.join(f'{n} {s:.2f}' for n, s in took.items())}")
    print(f"{len(answers)} requests answered, {len(errors)} failed")
    assert errors == []  # none lost
    assert set(answers) == {expected}  # none corrupt
    assert all(took[name] <= 5.0 for name in KILLED), took
    status = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", "status"],
        env={**os.environ, "TESSERA_RUN_FILE": str(cluster.run_file), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    # Each restart told to the cluster: the gateway counts those it heard (it was restarted
    # itself after the first three, and counts from there: its own restart, then the worker's).
    metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    for name in ("gateway", "worker-1"):
        assert f'tessera_cluster_service_restarts_total{{service="{name}"}} 1.0' in metrics
    for name in KILLED:
        row = next(line for line in status.stdout.splitlines() if line.startswith(f"{name} "))
        restarts = re.search(r"restarts (\d+)", row)
        said = "\n".join(line for line in cluster.lines if name in line)[-4000:]
        assert "running" in row and restarts and int(restarts[1]) >= 1, f"{row}\n{said}"
        # The last exit is the kill; or the scheduler's own when NATS was away longer than its
        # leader lease lets it act (2.5 s): it steps down, exits and is started again (never
        # two leaders), as supervision is for.
        stepped_down = (
            name == "scheduler"
            and "exited with code 1" in row
            and any("lost the leader lease" in line for line in cluster.lines)
        )
        assert "SIGKILL" in row or stepped_down, row
