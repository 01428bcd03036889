"""Batches with deadlines on the live cluster, beside interactive chat, measured in one run.

Starts `tessera up` as `make up` does and measures, with the official ``openai`` client:

- ``interactive_p99_ratio``: one client's chat requests, one after another, while a batch runs
  (``--batch`` requests through the Batch API), p99 latency ÷ the same requests with no batch
  (goal ≤ 1.25: batch requests yield to interactive ones, preempted while a chat runs);
- ``batch_throughput_ratio``: a batch's completion tokens/s (admitted to seen completed, no
  chat beside it) ÷ the same requests sent directly at ``--direct-concurrency`` streams
  (goal ≥ 0.8);
- per batch policy (``--policies``, each on a cluster of its own started with
  ``TESSERA_GATEWAY_BATCH_POLICY``, the first one also measuring the above), on the same
  ``--jobs`` batches of 2 to ``--job-size`` requests arriving over time with windows of 1.5
  to 4 × their need at the batch's measured tokens/s: ``deadlines_met`` (of the admitted, the
  share that ended within their window), ``declined`` (at submission), ``met_of_submitted``
  (batches that ended in time ÷ all submitted: what the user got) and
  ``planned_finish_error_median`` (|planned − actual end| ÷ the window, for the admitted).

EdgeFlow is not a live policy (docs/batch.md says why): the simulator runs it.

    python bench/jobs_live.py --json [--batch 48] [--interactive 12] [--jobs 6] [--tokens 32]
        [--policies edf,fifo,elasticflow]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.core.batch_policies import POLICIES
from libs.models.shipped import MODEL_NAME
from libs.runtime.procs import ServiceProcess, free_port
from services.gateway.batches.runner import QUIET_S

QUESTIONS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "Name a city."]
FINAL = ("completed", "failed", "expired", "cancelled")


def start_cluster(policy: str) -> tuple[ServiceProcess, str]:
    port = free_port()
    env = {
        "TESSERA_GATEWAY_BATCH_POLICY": policy,
        "TESSERA_GATEWAY_PORT": str(port),
        "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
        "TESSERA_RUN_FILE": str(Path(tempfile.mkdtemp()) / "cluster.json"),
        "TESSERA_HOME": tempfile.mkdtemp(prefix="tessera-home-"),  # a new cluster each run
    }
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    argv = ["-m", "libs.cli.main", "up"]
    child = ServiceProcess("tessera up", env, argv, ready_line=ready).start(ready_timeout_s=300)
    return child, f"http://127.0.0.1:{port}/v1"


def body(i: int, tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": tokens, "temperature": 0}


def submit(api: OpenAI, count: int, tokens: int, window: str) -> Any:
    lines = [
        {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": body(i, tokens)}
        for i in range(count)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = api.files.create(file=("batch.jsonl", content), purpose="batch")
    return api.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions",
        completion_window=window,  # type: ignore[arg-type]
    )  # fmt: skip


def wait(api: OpenAI, batch_id: str) -> Any:
    while (batch := api.batches.retrieve(batch_id)).status not in FINAL:
        time.sleep(0.1)
    return batch


def output_tokens(api: OpenAI, batch: Any) -> int:
    if batch.output_file_id is None:
        return 0
    rows = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    return sum(int(r["response"]["body"]["usage"]["completion_tokens"]) for r in rows)


def chats(api: OpenAI, count: int, tokens: int) -> list[float]:
    """Latencies of ``count`` chat requests sent one after another."""
    out = []
    for i in range(count):
        started = time.perf_counter()
        api.chat.completions.create(**body(i, tokens))
        out.append(time.perf_counter() - started)
    return out


def direct(base: str, count: int, tokens: int, streams: int) -> float:
    """Completion tokens/s of ``count`` requests sent directly, ``streams`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    api = OpenAI(base_url=base, api_key="-", max_retries=8)
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(
            pool.map(lambda i: api.chat.completions.create(**body(i, tokens)), range(count))
        )
    seconds = time.perf_counter() - started
    return float(sum(r.usage.completion_tokens for r in done if r.usage)) / seconds


def p99(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[98]
        if len(values) > 1
        else values[0]
    )


def deadline_mix(
    api: OpenAI, jobs: int, most: int, tokens: int, rate: float, seed: int
) -> dict[str, Any]:
    """``jobs`` batches arriving over time (exponential gaps), each with a window of 1.5 to 4 ×
    its need at ``rate`` tokens/s; which were admitted, and which of those met their window."""
    rng = random.Random(seed)
    admitted, declined = [], 0
    for _ in range(jobs):
        count = rng.randint(2, max(2, most))
        need = count * tokens / rate
        window = f"{max(5, round(need * rng.uniform(1.5, 4.0)))}s"
        try:
            admitted.append(submit(api, count, tokens, window))
        except Exception as exc:  # declined: a 400 with the reason
            if "deadline_unmeetable" not in str(getattr(exc, "code", "")):
                raise
            declined += 1
        time.sleep(rng.expovariate(1 / max(1.0, need / 2)))
    ended = [wait(api, b.id) for b in admitted]
    met = [b for b in ended if b.status == "completed" and b.completed_at <= b.expires_at]
    errors = [  # the end planned at admission against the end measured, per window
        abs(planned.model_extra["planned_finish_at"] - end.completed_at)
        / (end.expires_at - end.created_at)
        for planned, end in zip(admitted, ended, strict=True)
        if end.completed_at
    ]
    jobs_seen = [  # each admitted job: requests, window, planned and actual end (s after it came)
        {
            "requests": end.request_counts.total,
            "window_s": end.expires_at - end.created_at,
            "planned_s": planned.model_extra["planned_finish_at"] - end.created_at,
            "ended_s": (end.completed_at or end.expired_at) - end.created_at,
            "status": end.status,
        }
        for planned, end in zip(admitted, ended, strict=True)
    ]
    return {
        "jobs": jobs_seen,
        "deadlines_met": round(len(met) / len(ended), 3) if ended else None,
        "declined": declined,
        "met_of_submitted": round(len(met) / jobs, 3),
        "planned_finish_error_median": round(statistics.median(errors), 3) if errors else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    first, *others = args.policies.split(",")
    child, base = start_cluster(first)
    try:
        api = OpenAI(base_url=base, api_key="-", max_retries=8)
        chats(api, 1, args.tokens)  # warm
        alone = chats(api, args.interactive, args.tokens)
        time.sleep(QUIET_S)  # batches start once no chat ran for this long (by design)
        submitted = submit(api, args.batch, args.tokens, "1h")
        started = time.perf_counter()  # admitted: from here it runs, with no chat beside it
        batch = wait(api, submitted.id)
        batch_rate = output_tokens(api, batch) / (time.perf_counter() - started)
        direct_rate = direct(base, args.batch, args.tokens, args.direct_concurrency)
        running = submit(api, args.batch, args.tokens, "1h")
        beside = chats(api, args.interactive, args.tokens)
        wait(api, running.id)
        mixes = {first: deadline_mix(api, *mix_args(args, batch_rate))}
    finally:
        child.stop(timeout_s=30)
    for policy in others:  # the same arrivals, windows and sizes on a cluster of its own
        child, base = start_cluster(policy)
        try:
            api = OpenAI(base_url=base, api_key="-", max_retries=8)
            chats(api, 1, args.tokens)  # warm
            mixes[policy] = deadline_mix(api, *mix_args(args, batch_rate))
        finally:
            child.stop(timeout_s=30)
    per_policy = {
        key: {policy: mix[key] for policy, mix in mixes.items()}
        for key in ("deadlines_met", "declined", "met_of_submitted", "planned_finish_error_median")
    }
    return {
        "interactive_p99_alone_s": round(p99(alone), 3),
        "interactive_p99_with_batch_s": round(p99(beside), 3),
        "interactive_p99_ratio": round(p99(beside) / p99(alone), 3),
        "batch_tokens_per_s": round(batch_rate, 2),
        "direct_tokens_per_s": round(direct_rate, 2),
        "batch_throughput_ratio": round(batch_rate / direct_rate, 3),
        "batch_status": batch.status,
        **per_policy,
        "jobs": {policy: mix["jobs"] for policy, mix in mixes.items()},
    }


def mix_args(args: argparse.Namespace, rate: float) -> tuple[int, int, int, float, int]:
    return args.jobs, args.job_size, args.tokens, rate, args.seed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--batch", type=int, default=48, help="requests in the batch")
    parser.add_argument("--interactive", type=int, default=12, help="chat requests, each way")
    parser.add_argument("--jobs", type=int, default=6, help="batches in the deadline mix")
    parser.add_argument("--job-size", type=int, default=12, help="most requests of one of them")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--direct-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="batch policies compared, one cluster each"
    )
    add_results_option(parser)
    args = parser.parse_args()
    report = run(args)
    flat = {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in report.items()}
    write_report(args.results, "jobs_live", "Batches with deadlines, live", table([flat]))
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
