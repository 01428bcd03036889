"""Revoking a joined device that serves part of a deployment, while a series of requests runs
(``tessera revoke``): the deployment is placed again without it and every request completes
with the answer it gives alone (greedy): nothing lost, nothing twice. Revoked while the cluster
is stopped: the next `tessera up` on its home says it left and places the deployment again at
once, without waiting for it to come back. One host: the cluster listens on loopback and the
devices join over it (torch shards, asked for on both ends); ``test_two_hosts.py`` moves
shards off a host whose link goes down."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from libs.runtime.procs import ServiceProcess
from tests.e2e.cluster import RunningCluster
from tests.e2e.test_two_hosts import MEMORY_GB, MODEL, TORCH, joins, run_in

#: Requests one after the other; the device is revoked at the first piece of the first, which
#: asks for a long answer so that the revocation (a process that starts, then the user's
#: removal) lands well inside it (with 40 tokens a loaded CI machine ended the answer first).
REQUESTS = 2
TOKENS = 120
QUESTION = [
    {"role": "user", "content": "Count from one to one hundred in words, separated by commas."}
]
SERIES = (
    "import json, sys, time, openai; c = openai.OpenAI(base_url=sys.argv[1], api_key='-')\n"
    f"for i in range({REQUESTS}):\n"
    f"    s = c.chat.completions.create(model='{MODEL}', messages={QUESTION!r},"
    f" max_tokens={TOKENS}, temperature=0, stream=True)\n"
    "    for k in s:\n"
    "        if k.choices and k.choices[0].delta.content:\n"
    "            print(json.dumps([i, time.monotonic(), k.choices[0].delta.content]), flush=True)"
)


def test_a_revoked_device_s_shards_move_and_no_request_is_lost() -> None:
    head = RunningCluster(
        "--listen", "127.0.0.1", "--workers", "1", *TORCH,
        env={"TESSERA_WORKER_MEMORY_GB": MEMORY_GB},
    )  # fmt: skip
    joined: list[ServiceProcess] = []
    try:
        url, token = head.join_command()
        # Neither worker-0 nor laptop-b holds the model alone: it is split across both.
        joined.append(joins([], url, token, "laptop-b", "--memory-gb", MEMORY_GB, *TORCH))
        on_head = {"TESSERA_RUN_FILE": str(head.run_file)}
        deployed = run_in([], on_head, "-m", "libs.cli.main", "deploy", MODEL, "--id", MODEL)
        assert "worker-0" in deployed and "laptop-b" in deployed, deployed
        v1 = f"{head.base_url}/v1"
        [alone] = answers(
            run_in([], {}, "-c", SERIES.replace(f"range({REQUESTS})", "range(1)"), v1)
        )
        joined.append(
            joins([], url, token, "spare-c", "--memory-gb", "2", *TORCH)
        )  # room to move to

        series = subprocess.Popen(
            [sys.executable, "-c", SERIES, v1], stdout=subprocess.PIPE, text=True
        )
        assert series.stdout is not None
        lines, revoked_at = [], 0.0
        for line in series.stdout:
            lines.append(line)
            if len(lines) == 1:  # at the first piece of the first request
                revoke = ["env", f"TESSERA_RUN_FILE={head.run_file}", sys.executable]
                subprocess.run([*revoke, "-m", "libs.cli.main", "revoke", "laptop-b"], check=True)
                revoked_at = time.monotonic()
        assert series.wait(timeout=120) == 0
        assert answers("".join(lines)) == [alone] * REQUESTS
        first = [json.loads(line) for line in lines if json.loads(line)[0] == 0]
        assert first[-1][1] > revoked_at, "the first request ended before the revocation"
        print(f"revoked {first[-1][1] - revoked_at:.1f} s before the end of {len(first)} pieces")
        placed = run_in([], on_head, "-m", "libs.cli.main", "placements")
        assert MODEL in placed and "laptop-b" not in placed, placed
    finally:
        head.stop()
        for process in joined:
            process.stop(timeout_s=5)


def answers(output: str) -> list[str]:
    """Each request's text, from ``SERIES``' lines (request, time, piece)."""
    pieces = [json.loads(line) for line in output.splitlines()]
    return ["".join(p for i, _, p in pieces if i == n) for n in sorted({i for i, _, _ in pieces})]


def test_a_device_revoked_while_the_cluster_is_down_leaves_at_the_next_start() -> None:
    """A restored deployment waits for its devices to come back (here 600 s, where the old
    code waited before it moved); a device revoked meanwhile is said to have left instead, so
    the deployment is placed again without it before `ready`."""
    env = {"TESSERA_SCHEDULER_RESUME_WAIT_S": "600"}
    head = RunningCluster("--listen", "127.0.0.1", "--workers", "1", *TORCH, env=env)
    joined: list[ServiceProcess] = []
    try:
        url, token = head.join_command()
        joined.append(joins([], url, token, "laptop-b", "--memory-gb", MEMORY_GB, *TORCH))
        on_head = {"TESSERA_RUN_FILE": str(head.run_file)}
        told = ("--shards", "2", "--devices", "worker-0,laptop-b", "--id", "split")
        deployed = run_in([], on_head, "-m", "libs.cli.main", "deploy", MODEL, *told)
        assert "worker-0" in deployed and "laptop-b" in deployed, deployed
        head.stop()  # the cluster stops; the joined host is down too (a power cut, say)
        joined.pop().stop(timeout_s=5)

        nobody = {"TESSERA_RUN_FILE": str(head.run_file.parent / "none.json")}
        home = ("--home", str(head.home))
        said = run_in([], nobody, "-m", "libs.cli.main", "revoke", "laptop-b", *home)
        assert "revoked laptop-b" in said and "no cluster runs" in said, said

        head = RunningCluster(
            "--listen", "127.0.0.1", "--workers", "1", *TORCH, home=head.home, env=env
        )  # fmt: skip
        ready = head.wait_for("ready:", 240)
        lines = "\n".join(head.lines)
        assert "laptop-b was revoked while the cluster was down: it left" in lines, lines
        assert f"restored split ({MODEL}), serving on worker-0" in lines, lines
        assert "ready:" in ready
        asked = f"{head.base_url}/v1"
        one = SERIES.replace(f"range({REQUESTS})", "range(1)")
        [answer] = answers(run_in([], {}, "-c", one.replace(f"={TOKENS}", "=8"), asked))
        assert answer, lines
    finally:
        head.stop()
        for process in joined:
            process.stop(timeout_s=5)
