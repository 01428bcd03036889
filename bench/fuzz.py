"""Every NATS consumer of a running local cluster, flooded with malformed messages.

Starts ``tessera up`` (one worker, SmolLM2 deployed), sends ``--messages`` malformed payloads
round-robin over every channel (``libs/runtime/fuzz.py``: not JSON, not UTF-8, cut short,
scalars, wrong types, missing fields, deep nesting, empty; broken binary frames), then reports
what each service counted as rejected against what it was sent, whether any service exited,
and whether a chat request still completes.

    python bench/fuzz.py --messages 100000 --json

Goal (issue 10): 0 crashes, each rejection counted by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.builders: valid samples

from libs.runtime.bus import close_nats, connect_nats
from libs.runtime.fuzz import flood, tally
from libs.runtime.procs import free_port
from tests.builders import sample_messages

MODEL = "smollm2-135m-instruct"
Sent = dict[str, collections.Counter[str]]


async def send(nats_url: str, count: int, seed: int) -> Sent:
    nc = await connect_nats(nats_url, "fuzz")
    try:
        samples = sample_messages("worker-0")
        return await flood(nc, samples, count, seed=seed, device_id="worker-0", deployment_id=MODEL)
    finally:
        await close_nats(nc)


def start_cluster(port: int, run_file: Path) -> tuple[subprocess.Popen[str], list[str]]:
    env = dict(
        os.environ,
        TESSERA_GATEWAY_PORT=str(port),
        TESSERA_SCHEDULER_HTTP_PORT=str(free_port()),
        TESSERA_RUN_FILE=str(run_file),
    )
    tessera = Path(sys.executable).parent / "tessera"
    cluster = subprocess.Popen(
        [str(tessera), "up", "--devices", "0", "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert cluster.stdout is not None
        for line in cluster.stdout:
            lines.append(line.rstrip())
            if "ready:" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(240):
        cluster.kill()
        raise RuntimeError("the cluster did not start:\n" + "\n".join(lines[-30:]))
    return cluster, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run_file = Path(tempfile.mkdtemp()) / "cluster.json"
    port = free_port()
    cluster, lines = start_cluster(port, run_file)
    try:
        run = json.loads(run_file.read_text())
        started = time.perf_counter()
        sent = asyncio.run(send(run["nats_url"], args.messages, args.seed))
        send_s = time.perf_counter() - started
        deadline = time.monotonic() + 120
        while True:
            counts = tally(sent, run["metrics"])
            done = all(n == c for rows in counts.values() for n, c in rows.values())
            if done or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        crashed = [line for line in lines if "exited" in line]  # before we stop it
    finally:
        cluster.terminate()
        cluster.wait(60)
    kinds: collections.Counter[str] = collections.Counter()
    for by_kind in sent.values():
        kinds.update(by_kind)
    report = {
        "messages": args.messages,
        "send_seconds": round(send_s, 1),
        "sent_by_channel": {c: sum(k.values()) for c, k in sorted(sent.items())},
        "sent_by_kind": dict(sorted(kinds.items())),
        "rejected": {
            service: {c: {"sent": n, "counted": r} for c, (n, r) in rows.items()}
            for service, rows in counts.items()
        },
        "all_counted": done,
        "crashes": len(crashed),
        "chat_after_status": reply.status_code,
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if done and not crashed and reply.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
