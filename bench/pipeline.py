"""Tokens/s of SmolLM2 split into 1, 2 and 3 shards across worker processes over real NATS.

Starts a nats-server and three workers (``python -m services.worker``, one per device), places
the model as one, two and three shards (even layer split), and streams the same greedy prompts
through each placement in one run; reports decode tokens/s, the ratios to one shard and
whether all placements produced exactly the same tokens.

    python bench/pipeline.py --json [--prompts 4] [--max-tokens 64] [--threads 1]

Each worker runs with ``--threads`` torch threads (default 1: three workers share this
machine's two cores). Goal: 2-shard ≥ 0.8 × 1-shard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid

from report import add_results_option, table, write_report  # bench/ is the script's folder
from transformers import AutoTokenizer

from libs.cluster.servers import NatsServer
from libs.contracts import Sampling
from libs.harness.workers import LocalWorkers, even_split, place, shard_tasks
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats
from services.gateway.core.deployed import Deployed, hand_placed
from services.gateway.core.generation import GenerationClient

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me a short list of fruits.",
    "What is two plus two?",
)
DEVICES = ("bench-a", "bench-b", "bench-c")


async def measure(
    nats_url: str, prompts: list[list[int]], max_tokens: int, shards: int
) -> tuple[float, list[list[int]]]:
    nc = await connect_nats(nats_url, f"bench-{shards}")
    try:
        deployment = f"bench{shards}-{uuid.uuid4().hex[:6]}"
        tasks = shard_tasks(deployment, MODEL_NAME, DEVICES[:shards], even_split(30, shards), 1)
        states = [s.state for s in await place(nc, tasks)]
        if states != ["loaded"] * shards:
            raise RuntimeError(f"placement failed: {states}")
        book = Deployed()
        book.hold(hand_placed(tasks))
        client = GenerationClient(NatsBus(nc), book)
        outputs: list[list[int]] = []
        tokens, seconds = 0, 0.0
        for ids in prompts:
            out: list[int] = []
            first_at = None
            async for chunk in client.stream(
                deployment, uuid.uuid4().hex[:12], ids, Sampling(max_tokens=max_tokens)
            ):
                if chunk.error:
                    raise RuntimeError(chunk.error)
                if chunk.token_id is not None:
                    out.append(chunk.token_id)
                    if first_at is None:
                        first_at = time.perf_counter()  # decode speed: after the first token
            done = time.perf_counter()
            if first_at is not None and len(out) > 1:
                tokens += len(out) - 1
                seconds += done - first_at
            outputs.append(out)
            print(f"  {shards} shard(s): {len(out)} tokens", file=sys.stderr)
        return tokens / seconds, outputs
    finally:
        await close_nats(nc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    add_results_option(parser)
    args = parser.parse_args()
    folder = prepare()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]
    ]
    env = {"OMP_NUM_THREADS": str(args.threads), "TESSERA_WORKER_SPEED_FACTOR": "1.0"}
    with NatsServer() as server, LocalWorkers(server.url, DEVICES, env=env):
        results = {
            n: asyncio.run(measure(server.url, prompts, args.max_tokens, n)) for n in (1, 2, 3)
        }
    rate = {str(n): round(r[0], 2) for n, r in results.items()}
    report = {
        "model": MODEL_NAME,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads_per_worker": args.threads,
        "tokens_per_s": rate,
        "ratio_2_1": round(results[2][0] / results[1][0], 3),
        "ratio_3_1": round(results[3][0] / results[1][0], 3),
        "identical_tokens": results[1][1] == results[2][1] == results[3][1],
        "goal_ratio_2_1": 0.8,
    }
    write_report(
        args.results, "pipeline", "SmolLM2 split into 1, 2 and 3 shards over NATS", table(report)
    )
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
