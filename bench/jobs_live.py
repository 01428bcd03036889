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

``edgeflow``'s cluster gets an edge: the model deployed a second time (``smollm2-edge``) on a
worker its first deployment does not use (``--edge-device``), an edge server for the batches
the cloud declines. With ``--fleet`` the cluster is that fleet file's, each worker held to its
size by the kernel (on ``make up``'s two workers the edge copy shares the cloud's cores).

Beside each policy's measurement, the simulator's prediction for the same arrivals
(``libs/sim/batches.py``: the same policy code, with the tokens/s measured here at 1, 2, 4 and
8 requests at once, the edge's too, in place of the devices): ``predicted_deadlines_met`` and
``predicted_declined``.

    python bench/jobs_live.py --json [--batch 48] [--interactive 12] [--jobs 6] [--tokens 32]
        [--policies edf,fifo,elasticflow,edgeflow]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from openai import OpenAI
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.cluster.up import follow_deployment
from libs.core.batch_policies import POLICIES
from libs.models.shipped import MODEL_NAME
from libs.runtime.procs import ServiceProcess, free_port
from libs.sim.batches import Arrival, simulate
from services.gateway.batches.runner import QUIET_S

#: The edge copy ``edgeflow``'s cluster gets, and the runner's streams (the gateway's default).
EDGE = "smollm2-edge"
STREAMS = 8
AT_ONCE = (1, 2, 4, 8)

QUESTIONS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "Name a city."]
FINAL = ("completed", "failed", "expired", "cancelled")


def start_cluster(
    policy: str, fleet: Path | None = None, edge_device: str | None = None
) -> tuple[ServiceProcess, str]:
    port, scheduler = free_port(), free_port()
    env = {
        "TESSERA_GATEWAY_BATCH_POLICY": policy,
        "TESSERA_GATEWAY_PORT": str(port),
        "TESSERA_SCHEDULER_HTTP_PORT": str(scheduler),
        "TESSERA_RUN_FILE": str(Path(tempfile.mkdtemp()) / "cluster.json"),
        "TESSERA_HOME": tempfile.mkdtemp(prefix="tessera-home-"),  # a new cluster each run
    }
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    argv = ["-m", "libs.cli.main", "up", *(["--fleet", str(fleet)] if fleet else [])]
    child = ServiceProcess("tessera up", env, argv, ready_line=ready).start(ready_timeout_s=300)
    if policy == "edgeflow":
        try:
            add_edge(f"http://127.0.0.1:{scheduler}", edge_device)
        except Exception:
            child.stop(timeout_s=30)
            raise
    return child, f"http://127.0.0.1:{port}/v1"


def add_edge(scheduler: str, device: str | None) -> None:
    """Deploy the model again as ``EDGE``: on ``device``, else on the first device (by name)
    its first deployment does not use that takes it (emulated devices run no engine)."""
    first = follow_deployment(scheduler, MODEL_NAME.replace(".", "-"), 120) or {}
    used = {s["device_id"] for s in first.get("shards", ())}
    with urllib.request.urlopen(f"{scheduler}/healthz", timeout=10) as answer:
        devices = sorted(json.loads(answer.read()).get("devices", ()))
    refusals = []
    for candidate in [device] if device else [d for d in devices if d not in used]:
        told = {"model": MODEL_NAME, "deployment_id": EDGE, "devices": [candidate]}
        request = urllib.request.Request(
            f"{scheduler}/placements",
            json.dumps(told).encode(),
            {"content-type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=30).read()
        except urllib.error.HTTPError as exc:
            refusals.append(f"{candidate}: {exc.read().decode(errors='replace')[:200]}")
            continue
        status = follow_deployment(scheduler, EDGE, 300) or {}
        if status.get("phase") != "serving":
            raise RuntimeError(f"the edge copy did not serve on {candidate}: {status}")
        return
    raise RuntimeError(f"no device took the edge copy: {'; '.join(refusals) or 'none free'}")


def body(i: int, tokens: int, model: str = MODEL_NAME) -> dict[str, Any]:
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}


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


def direct(base: str, count: int, tokens: int, streams: int, model: str = MODEL_NAME) -> float:
    """Completion tokens/s of ``count`` requests sent directly, ``streams`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    api = OpenAI(base_url=base, api_key="-", max_retries=8)
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(
            pool.map(lambda i: api.chat.completions.create(**body(i, tokens, model)), range(count))
        )
    seconds = time.perf_counter() - started
    return float(sum(r.usage.completion_tokens for r in done if r.usage)) / seconds


def p99(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[98]
        if len(values) > 1
        else values[0]
    )


def curve(base: str, tokens: int, model: str = MODEL_NAME) -> dict[int, float]:
    """Completion tokens/s of ``model`` at each of ``AT_ONCE`` requests at once, sent directly."""
    return {k: round(direct(base, 2 * k, tokens, k, model), 2) for k in AT_ONCE}


def deadline_mix(
    api: OpenAI, jobs: int, most: int, tokens: int, rate: float, seed: int, made: float
) -> dict[str, Any]:
    """``jobs`` batches arriving over time (exponential gaps), each with a window of 1.5 to 4 ×
    its need at ``rate`` tokens/s; which were admitted, and which of those met their window.
    ``made``: the tokens a request makes on average (for the simulator's prediction)."""
    rng = random.Random(seed)
    admitted, declined, arrivals = [], 0, []
    first = time.monotonic()
    for _ in range(jobs):
        count = rng.randint(2, max(2, most))
        need = count * tokens / rate
        window = f"{max(5, round(need * rng.uniform(1.5, 4.0)))}s"
        at = time.monotonic() - first
        arrivals.append(Arrival(at, count, tokens, float(window[:-1]), made))
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
            "edge": end.model_extra.get("edge_deployment"),
        }
        for planned, end in zip(admitted, ended, strict=True)
    ]
    return {
        "jobs": jobs_seen,
        "arrivals": arrivals,
        "deadlines_met": round(len(met) / len(ended), 3) if ended else None,
        "declined": declined,
        "met_of_submitted": round(len(met) / jobs, 3),
        "planned_finish_error_median": round(statistics.median(errors), 3) if errors else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    first, *others = args.policies.split(",")
    child, base = start_cluster(first, args.fleet, args.edge_device)
    try:
        api = OpenAI(base_url=base, api_key="-", max_retries=8)
        chats(api, 1, args.tokens)  # warm
        alone = chats(api, args.interactive, args.tokens)
        time.sleep(QUIET_S)  # batches start once no chat ran for this long (by design)
        submitted = submit(api, args.batch, args.tokens, "1h")
        started = time.perf_counter()  # admitted: from here it runs, with no chat beside it
        batch = wait(api, submitted.id)
        made = output_tokens(api, batch)
        batch_rate = made / (time.perf_counter() - started)
        per_request = made / max(1, batch.request_counts.total)  # tokens a request makes
        direct_rate = direct(base, args.batch, args.tokens, args.direct_concurrency)
        rates = curve(base, args.tokens)  # what the simulator's prediction runs at
        running = submit(api, args.batch, args.tokens, "1h")
        beside = chats(api, args.interactive, args.tokens)
        wait(api, running.id)
        lanes = {EDGE: curve(base, args.tokens, EDGE)} if first == "edgeflow" else {}
        mixes = {first: deadline_mix(api, *mix_args(args, batch_rate, per_request))}
    finally:
        child.stop(timeout_s=30)
    for policy in others:  # the same arrivals, windows and sizes on a cluster of its own
        child, base = start_cluster(policy, args.fleet, args.edge_device)
        try:
            api = OpenAI(base_url=base, api_key="-", max_retries=8)
            chats(api, 1, args.tokens)  # warm
            if policy == "edgeflow":
                lanes = {EDGE: curve(base, args.tokens, EDGE)}
            mixes[policy] = deadline_mix(api, *mix_args(args, batch_rate, per_request))
        finally:
            child.stop(timeout_s=30)
    for policy, mix in mixes.items():  # the simulator on the same arrivals and measured curves
        told = lanes if policy == "edgeflow" else {}
        predicted = simulate(policy, mix.pop("arrivals"), rates, STREAMS, told)
        mix["predicted_deadlines_met"] = predicted.deadlines_met
        mix["predicted_declined"] = predicted.declined
    per_policy = {
        key: {policy: mix[key] for policy, mix in mixes.items()}
        for key in (
            "deadlines_met",
            "predicted_deadlines_met",
            "declined",
            "predicted_declined",
            "met_of_submitted",
            "planned_finish_error_median",
        )
    }
    return {
        "interactive_p99_alone_s": round(p99(alone), 3),
        "interactive_p99_with_batch_s": round(p99(beside), 3),
        "interactive_p99_ratio": round(p99(beside) / p99(alone), 3),
        "batch_tokens_per_s": round(batch_rate, 2),
        "direct_tokens_per_s": round(direct_rate, 2),
        "batch_throughput_ratio": round(batch_rate / direct_rate, 3),
        "batch_status": batch.status,
        "tokens_per_request": round(per_request, 1),
        "tokens_per_s_by_requests_at_once": rates,
        "edge_tokens_per_s_by_requests_at_once": lanes or None,
        **per_policy,
        "jobs": {policy: mix["jobs"] for policy, mix in mixes.items()},
    }


def mix_args(
    args: argparse.Namespace, rate: float, made: float
) -> tuple[int, int, int, float, int, float]:
    return args.jobs, args.job_size, args.tokens, rate, args.seed, made


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
        "--fleet",
        type=Path,
        help="a fleet file for `tessera up --fleet` (each worker held to its size by the "
        "kernel: e.g. deploy/fleets/home.yaml)",
    )
    parser.add_argument(
        "--edge-device",
        help="where edgeflow's cluster deploys the model's edge copy (default: the first "
        "worker, by name, its first deployment does not use)",
    )
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
