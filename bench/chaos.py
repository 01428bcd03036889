"""Faults under load: completed, failed, lost and recovery time per fault.

By default the faults strike a running ``tessera up`` as a user meets them
(``libs/harness/up_chaos.py``): SIGKILL of each service's process, of the worker holding the
model, of Redis, of nats-server (of one of three with ``--nats-servers 3``), and of every
process at once, a power cut, followed by ``tessera up`` on the same home. The cluster's own
supervision brings each back; the harness restarts nothing. Clients retry as OpenAI's client
does (``retried`` counts the requests that needed it). Goal: 0 lost, 0 corrupt; each process
back within 5 s.

    python bench/chaos.py --requests 1000 --json [--faults scorer_kill,power_cut]
    python bench/chaos.py --nats-servers 3               # NATS as a cluster of three

``--in-process`` runs the harness's own faults instead (``libs/harness/chaos.py``: a lying
device, a worker that refuses its shard or dies loading, the leading one of two scheduler
replicas): it runs the cluster in this process and starts again what it killed itself.
Their goal: recovery within 3 heartbeat intervals + 1 s; the placement faults add no request
sent to the refusing worker (``misrouted``) and the model serving again within that bound.

Writes the table to ``bench/results/chaos.md`` (``chaos-nats-cluster.md`` with three NATS
servers; ``chaos-in-process.md`` for ``--in-process``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from report import add_results_option, write_report  # bench/ is the script's folder

from libs.harness import up_chaos
from libs.harness.chaos import FAULTS, NATS_CLUSTER_FAULTS, Chaos
from libs.harness.chaos_outcomes import Outcome, table
from libs.harness.placement_faults import FAULTS as PLACEMENT_FAULTS

#: Each process back within this many seconds of its kill (supervised faults).
BACK_GOAL_S = 5.0


def supervised(args: argparse.Namespace) -> int:
    """The faults of a running ``tessera up``, brought back by its supervision."""
    extra = up_chaos.NATS_CLUSTER_FAULTS if args.nats_servers == 3 else ()
    faults = [f for f in up_chaos.FAULTS if not (extra and f == "nats_kill")] + list(extra)
    chosen = args.faults.split(",") if args.faults else faults
    chaos = up_chaos.UpChaos(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        nats_servers=args.nats_servers,
        engine=args.engine,
        log=open(args.log, "w") if args.log else None,  # noqa: SIM115 (closed at exit)
    )
    chaos.start()
    outcomes: list[Outcome] = []
    try:
        for fault in chosen:
            outcomes.append(chaos.run(fault, args.requests))
            print(f"{fault}: {outcomes[-1].row()}", file=sys.stderr)
    finally:
        chaos.stop()
    kills = [o for o in outcomes if o.fault != "power_cut"]
    report = {
        "harness": "tessera up, its own supervision",
        "requests_per_fault": args.requests,
        "nats_servers": args.nats_servers,
        "engine": chaos.engine,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "client_retries_for_s": chaos.chat.retry_for_s,
        "back_goal_s": BACK_GOAL_S,
        "faults": {o.fault: o.row() for o in outcomes},
        "all_back_within_goal": all(
            o.back_s is not None and o.back_s <= BACK_GOAL_S for o in kills
        ),
    }
    write_report(
        args.results,
        "chaos" if args.nats_servers == 1 else "chaos-nats-cluster",
        "Chaos results",
        f"`tessera up` ({chaos.engine}), its processes killed with SIGKILL and brought back by "
        f"its own supervision (a power cut: every process at once, then `tessera up` on the "
        f"same home); {args.concurrency} concurrent streams, {args.max_tokens} tokens each, "
        f"clients retrying as OpenAI's does for up to {chaos.chat.retry_for_s:g} s; back "
        f"(s): from the kill until `tessera up` said it was back (the power cut: `ready`); "
        f"goal {BACK_GOAL_S:g} s.\n\n{table(outcomes)}",
    )
    return said(args, report, outcomes)


def said(args: argparse.Namespace, report: dict[str, Any], outcomes: list[Outcome]) -> int:
    """Print the report; the exit status: 1 when a request was lost or corrupt."""
    print(json.dumps(report, indent=None if args.json else 2))
    lost = sum(o.counts["lost"] + o.counts["corrupt"] for o in outcomes)
    return 0 if lost == 0 else 1


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
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the harness's own faults, on a cluster run in this process (see above)",
    )
    parser.add_argument("--log", default=None, help="where tessera up's output goes")
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    if not args.in_process:
        return supervised(args)
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
        "chaos-in-process" if args.nats_servers == 1 else "chaos-nats-cluster-in-process",
        "Chaos results, the harness's own faults",
        f"The {chaos.options.cpu_engine} engine: {args.concurrency} concurrent streams, "
        f"{args.max_tokens} tokens each, heartbeat every {chaos.interval_s} s; recovery goal "
        f"3 intervals + 1 s = {goal_s:g} s.\n\n{table(outcomes)}",
    )
    return said(args, report, outcomes)


if __name__ == "__main__":
    sys.exit(main())
