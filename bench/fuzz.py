"""Every NATS consumer of a running local cluster, flooded with malformed messages.

Runs ``tessera up``'s cluster in this process (one worker, SmolLM2 deployed), sends
``--messages`` malformed payloads round-robin over every channel (``libs/harness/fuzz.py``:
not JSON, not UTF-8, cut short, scalars, wrong types, missing fields, deep nesting, empty;
broken binary frames), then reports what each service counted as rejected against what it was
sent, whether any service exited, and whether a chat request still completes.

    python bench/fuzz.py --messages 100000 --json

Goal: 0 crashes, each rejection counted by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from report import add_results_option, table, write_report  # bench/ is the script's folder
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.builders: valid samples

from libs.cluster.launcher import Cluster
from libs.cluster.up import deploy_model
from libs.cluster.up_options import UpOptions
from libs.harness.fuzz import flood, tally
from libs.runtime.nats_client import close_nats, connect_nats
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    port = free_port()
    log = (Path(tempfile.mkdtemp()) / "cluster.log").open("w")
    options = UpOptions(gateway_port=port, devices=0, workers=1, scheduler_port=free_port())
    cluster = Cluster(options, Console(file=log, width=200))
    try:
        cluster.start()
        if not cluster.wait_ready() or not deploy_model(options, MODEL).startswith("deployed"):
            raise RuntimeError(f"the cluster did not start; see {log.name}")
        started = time.perf_counter()
        sent = asyncio.run(send(cluster.urls("admin")["nats"], args.messages, args.seed))
        send_s = time.perf_counter() - started
        deadline = time.monotonic() + 120
        while True:
            counts = tally(sent, cluster.metrics_targets())
            done = all(n == c for rows in counts.values() for n, c in rows.values())
            if done or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        crashed = [c.name for c in cluster.children if c.process.poll() is not None]
    finally:
        cluster.stop()
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
    write_report(
        args.results, "fuzz", "Malformed messages against every NATS consumer", table(report)
    )
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if done and not crashed and reply.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
