"""Tokens/s and time to first token through the gateway vs the same engine called in-process.

Starts ``tessera up`` with one CPU worker (SmolLM2 deployed on it), streams the same greedy
prompts through the OpenAI API (HTTP + SSE -> gateway -> NATS -> worker) and through a
``ShardModel`` of the whole model in this process, with the same torch thread count (1, as the
launcher gives each worker), in one run.

    python bench/gateway.py --json [--prompts 4] [--max-tokens 48]

Goal (issue 8): gateway tokens/s ≥ 0.9 × direct.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from libs.contracts import Sampling
from libs.models.chat import encode_chat
from libs.models.decoding import sample
from libs.models.shard import ShardModel
from libs.models.store import MODEL_NAME, prepare
from libs.runtime.procs import free_port

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a CPU does in two sentences.",
)


def direct(prompts: list[list[int]], max_tokens: int, stop_ids: set[int]) -> tuple[float, float]:
    torch.set_num_threads(1)
    model = ShardModel(prepare(), 0, 30)
    ttfts, tokens, seconds = [], 0, 0.0
    for ids in prompts:
        cache = model.new_cache()
        started = time.perf_counter()
        rows = torch.tensor([ids])
        first_at = None
        for index in range(max_tokens):
            token = sample(model.forward(rows, cache), Sampling(), "bench", index)
            now = time.perf_counter()
            if first_at is None:
                first_at = now
                ttfts.append(now - started)
            else:
                tokens += 1
            if token in stop_ids:
                break
            rows = torch.tensor([[token]])
        seconds += time.perf_counter() - (first_at or started)
    return tokens / seconds, 1000 * sum(ttfts) / len(ttfts)


def through_gateway(url: str, texts: list[str], max_tokens: int) -> tuple[float, float]:
    ttfts, tokens, seconds = [], 0, 0.0
    with httpx.Client(timeout=120) as http:
        for text in texts:
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            started = time.perf_counter()
            first_at = None
            count = 0
            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:]).get("choices", [])
                    if choices and choices[0].get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if first_at is None:
                            first_at = now
                            ttfts.append(now - started)
                        else:
                            count += 1
            tokens += count
            seconds += time.perf_counter() - (first_at or started)
    return tokens / seconds, 1000 * sum(ttfts) / len(ttfts)


def start_cluster(port: int) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        TESSERA_GATEWAY_PORT=str(port),
        TESSERA_SCHEDULER_HTTP_PORT=str(free_port()),
        TESSERA_RUN_FILE=str(Path(tempfile.mkdtemp()) / "cluster.json"),
    )
    tessera = Path(sys.executable).parent / "tessera"
    proc = subprocess.Popen(
        [str(tessera), "up", "--devices", "0", "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready:" in line:
            return proc
    raise RuntimeError("the cluster did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    texts = list(PROMPTS[: args.prompts])
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    port = free_port()
    cluster = start_cluster(port)
    try:
        url = f"http://127.0.0.1:{port}"
        through_gateway(url, texts[:1], 4)  # warm-up: the shard loads, the tokenizer loads
        gateway_rate, gateway_ttft = through_gateway(url, texts, args.max_tokens)
    finally:
        cluster.terminate()
        cluster.wait(30)
    direct_rate, direct_ttft = direct(prompts, args.max_tokens, {int(tokenizer.eos_token_id)})
    report = {
        "model": MODEL_NAME,
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "gateway_tokens_per_s": round(gateway_rate, 2),
        "direct_tokens_per_s": round(direct_rate, 2),
        "ratio": round(gateway_rate / direct_rate, 3),
        "gateway_ttft_ms": round(gateway_ttft, 1),
        "direct_ttft_ms": round(direct_ttft, 1),
        "goal_ratio": 0.9,
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
