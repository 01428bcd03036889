"""Tokens/s and time to first token through the gateway vs the same engine called in-process.

Starts ``tessera up`` with one CPU worker (SmolLM2 deployed on it), streams the same greedy
prompts through the OpenAI API (HTTP + SSE -> gateway -> NATS -> worker) and through a
``ShardModel`` of the whole model in this process, with the same torch thread count (1, as the
launcher gives each worker), alternating prompt by prompt in one run.

    python bench/gateway.py --json [--prompts 4] [--max-tokens 48] [--rounds 2]

Goal: gateway tokens/s ≥ 0.9 × direct.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from report import add_results_option, table, write_report  # bench/ is the script's folder
from transformers import AutoTokenizer

from libs.contracts import Sampling
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.procs import ServiceProcess, free_port
from services.worker.torch.decoding import sample
from services.worker.torch.shard import ShardModel

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a CPU does in two sentences.",
)


Run = tuple[int, float, float]  #: tokens after the first, seconds after the first, TTFT (s)


def direct(model: ShardModel, ids: list[int], max_tokens: int, stop_ids: set[int]) -> Run:
    """One greedy generation on the engine in this process."""
    cache = model.new_cache()
    started = time.perf_counter()
    rows = torch.tensor([ids])
    first_at, tokens = None, 0
    for index in range(max_tokens):
        token = sample(model.forward(rows, cache), Sampling(), "bench", index)
        now = time.perf_counter()
        if first_at is None:
            first_at = now
        else:
            tokens += 1
        if token in stop_ids:
            break
        rows = torch.tensor([[token]])
    assert first_at is not None
    return tokens, time.perf_counter() - first_at, first_at - started


def through_gateway(http: httpx.Client, url: str, text: str, max_tokens: int) -> Run:
    """One greedy generation streamed through the OpenAI API."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first_at, tokens = None, 0
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices", [])
            if choices and choices[0].get("delta", {}).get("content"):
                if first_at is None:
                    first_at = time.perf_counter()
                else:
                    tokens += 1
    assert first_at is not None
    return tokens, time.perf_counter() - first_at, first_at - started


def rates(runs: list[Run]) -> tuple[float, float]:
    """Tokens/s after the first token, and mean TTFT in ms."""
    tokens = sum(r[0] for r in runs)
    seconds = sum(r[1] for r in runs)
    return tokens / seconds, 1000 * sum(r[2] for r in runs) / len(runs)


def start_cluster(port: int) -> ServiceProcess:
    env = {
        "TESSERA_GATEWAY_PORT": str(port),
        "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
        "TESSERA_RUN_FILE": str(Path(tempfile.mkdtemp()) / "cluster.json"),
        "TESSERA_HOME": tempfile.mkdtemp(prefix="tessera-home-"),  # a new cluster each run
    }
    argv = ["-m", "libs.cli.main", "up", "--devices", "0", "--workers", "1"]
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    return ServiceProcess("tessera up", env, argv, ready_line=ready).start(ready_timeout_s=300)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    add_results_option(parser)
    args = parser.parse_args()
    texts = list(PROMPTS[: args.prompts])
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    torch.set_num_threads(1)  # as the launcher gives each worker
    model = ShardModel(prepare(), 0, 30)
    stop_ids = {int(tokenizer.eos_token_id)}
    port = free_port()
    cluster = start_cluster(port)
    gateway_runs: list[Run] = []
    direct_runs: list[Run] = []
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as http:
            through_gateway(http, url, texts[0], 4)  # warm-up: the tokenizer loads
            # Side by side, prompt by prompt, with the cluster up for both: drift and background
            # load fall on the two alike.
            for _ in range(args.rounds):
                for text, ids in zip(texts, prompts, strict=True):
                    gateway_runs.append(through_gateway(http, url, text, args.max_tokens))
                    direct_runs.append(direct(model, ids, args.max_tokens, stop_ids))
    finally:
        cluster.stop(timeout_s=30)
    gateway_rate, gateway_ttft = rates(gateway_runs)
    direct_rate, direct_ttft = rates(direct_runs)
    report = {
        "model": MODEL_NAME,
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "gateway_tokens_per_s": round(gateway_rate, 2),
        "direct_tokens_per_s": round(direct_rate, 2),
        "ratio": round(gateway_rate / direct_rate, 3),
        "gateway_ttft_ms": round(gateway_ttft, 1),
        "direct_ttft_ms": round(direct_ttft, 1),
        "goal_ratio": 0.9,
    }
    write_report(
        args.results, "gateway", "Through the gateway against the engine in-process", table(report)
    )
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
