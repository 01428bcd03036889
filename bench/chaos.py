"""Faults under load: completed, failed, lost and recovery time per fault.

Runs the local cluster in this process (two workers, SmolLM2), a steady load of short greedy
chat streams through the gateway, and injects each fault in turn (``libs/harness/chaos.py``).
Writes the table to ``bench/results/chaos.md`` too (``chaos-nats-cluster.md`` with three NATS
servers).

    python bench/chaos.py --requests 1000 --json [--faults worker_kill,nats_restart]
    python bench/chaos.py --nats-servers 3 --faults nats_member_kill   # NATS as a cluster

Goal: 0 lost in every fault; recovery within 3 heartbeat intervals + 1 s; no duplicate tokens.
The placement faults (a worker that refuses its shard, a worker killed while loading) add: no
request sent to that worker (``misrouted``), and the model placed again and serving within 3
heartbeat intervals + 1 s of the refusal or the kill (``replace_s``).
"""

from __future__ import annotations

import argparse
import json
import sys

from report import add_results_option, write_report  # bench/ is the script's folder

from libs.harness.chaos import FAULTS, NATS_CLUSTER_FAULTS, Chaos
from libs.harness.chaos_outcomes import table
from libs.harness.placement_faults import FAULTS as PLACEMENT_FAULTS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="per fault")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--faults", default=None, help="default: every fault the cluster has")
    parser.add_argument("--nats-servers", type=int, default=1, choices=(1, 3))
    parser.add_argument(
        "--engine",
        choices=("torch", "llamacpp"),
        default=None,
        help="the CPU workers' engine (default: as `make up` chooses)",
    )
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    faults = FAULTS + (NATS_CLUSTER_FAULTS if args.nats_servers == 3 else ())
    args.faults = args.faults or ",".join(faults)
    chaos = Chaos(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        nats_servers=args.nats_servers,
        engine=args.engine,
    )
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
        "nats_servers": args.nats_servers,
        "engine": chaos.options.cpu_engine,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "heartbeat_interval_s": chaos.interval_s,
        "recovery_goal_s": goal_s,
        "faults": {o.fault: o.row() for o in outcomes},
        "all_within_goal": all(
            o.recovery_s is not None and o.recovery_s <= goal_s for o in outcomes
        ),
        "placement_goals_met": all(
            o.misrouted == 0 and o.replace_s is not None and o.replace_s <= goal_s
            for o in outcomes
            if o.fault in PLACEMENT_FAULTS
        ),
    }
    write_report(
        args.results,
        "chaos" if args.nats_servers == 1 else "chaos-nats-cluster",
        "Chaos results",
        f"The {chaos.options.cpu_engine} engine: {args.concurrency} concurrent streams, "
        f"{args.max_tokens} tokens each, heartbeat every {chaos.interval_s} s; recovery goal "
        f"3 intervals + 1 s = {goal_s:g} s.\n\n{table(outcomes)}",
    )
    print(json.dumps(report, indent=None if args.json else 2))
    lost = sum(o.counts["lost"] + o.counts["corrupt"] for o in outcomes)
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
