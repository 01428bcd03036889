"""Faults under load: completed, failed, lost and recovery time per fault (issue 10).

Runs the local cluster in this process (two workers, SmolLM2), a steady load of short greedy
chat streams through the gateway, and injects each fault in turn (``libs/harness/chaos.py``).
Writes the table to ``bench/results/chaos.md`` too.

    python bench/chaos.py --requests 1000 --json [--faults worker_kill,nats_restart]

Goal: 0 lost in every fault; recovery within 3 heartbeat intervals + 1 s; no duplicate tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from libs.harness.chaos import FAULTS, Chaos, table

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="per fault")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chaos = Chaos(concurrency=args.concurrency, max_tokens=args.max_tokens)
    chaos.start()
    outcomes = []
    try:
        for fault in args.faults.split(","):
            outcomes.append(chaos.run(fault, args.requests))
            print(f"{fault}: {outcomes[-1].row()}", file=sys.stderr)
    finally:
        chaos.stop()
    goal_s = 3 * chaos.interval_s + 1.0
    report = {
        "requests_per_fault": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "heartbeat_interval_s": chaos.interval_s,
        "recovery_goal_s": goal_s,
        "faults": {o.fault: o.row() for o in outcomes},
        "all_within_goal": all(
            o.recovery_s is not None and o.recovery_s <= goal_s for o in outcomes
        ),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        f"# Chaos results\n\n`python bench/chaos.py --requests {args.requests}` "
        f"({args.concurrency} concurrent streams, {args.max_tokens} tokens each, heartbeat "
        f"every {chaos.interval_s} s; recovery goal 3 intervals + 1 s = {goal_s:g} s):\n\n"
        f"{table(outcomes)}\n"
    )
    print(json.dumps(report, indent=None if args.json else 2))
    lost = sum(o.counts["lost"] + o.counts["corrupt"] for o in outcomes)
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
