"""One stream, in one process: the int8 shard engine against llama.cpp on the same model.

The figure behind the engines' choice (docs/getting-started.md). Each runs SmolLM2-135M-Instruct
whole in this machine's process with 2 threads, 64-token greedy chat completions of the same
prompts, one after another (no gateway, no batching). llama.cpp runs as the llamacpp worker
runs it: its server from ``make llama``'s build, one slot, over HTTP on loopback. With
``--llama-python`` (the Python of a virtualenv that has ``llama-cpp-python``) it runs in that
process instead, through llama-cpp-python's API, as the first measurements did.

    python bench/engines.py --json [--rounds 2] [--llama-python /tmp/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import add_results_option, table, write_report  # bench/ is the script's folder

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a CPU does in two sentences.",
)
LLAMA = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=2048, verbose=False)
ask = lambda text, n: llm.create_chat_completion(
    messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0)
ask("Hi", 8)
rates = []
for text in json.loads(sys.argv[2]):
    started = time.perf_counter()
    tokens = ask(text, 64)["usage"]["completion_tokens"]
    rates.append(tokens / (time.perf_counter() - started))
print(json.dumps(rates))
"""


def shard_engine_rates(prompts: list[str]) -> list[float]:
    import torch
    from transformers import AutoTokenizer

    from libs.models.chat import encode_chat
    from libs.models.shipped import prepare
    from services.worker.torch.shard import ShardModel, greedy

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    model = ShardModel(prepare(), 0, 30)
    stop = frozenset({tokenizer.eos_token_id})
    chat = lambda text: encode_chat(tokenizer, [{"role": "user", "content": text}])  # noqa: E731
    greedy(model, chat("Hi"), 8, stop)
    rates = []
    for text in prompts:
        started = time.perf_counter()
        tokens = greedy(model, chat(text), 64, stop)
        rates.append(len(tokens) / (time.perf_counter() - started))
    return rates


def llama_server_rates(prompts: list[str]) -> list[float]:
    """llama.cpp's tokens/s on each prompt, through its server (``make llama``'s build) with
    2 threads and one slot, as the llamacpp worker starts it."""
    import asyncio

    import httpx

    from libs.models.shipped import gguf_path
    from services.worker.served.llama_server import LlamaServer
    from services.worker.served.llama_worker import LAYERS, whole_task
    from services.worker.settings import WorkerSettings

    task = whole_task("engines", "engines")
    server = LlamaServer(WorkerSettings().llama_bin, gguf_path(), task, LAYERS, threads=2, slots=1)
    with asyncio.Runner() as loop:  # one loop: the server's process belongs to it
        loop.run(server.start())
        try:
            with httpx.Client(base_url=server.url, timeout=300) as http:

                def ask(text: str, tokens: int) -> int:
                    body = {
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": tokens,
                        "temperature": 0,
                    }
                    answer = http.post("/v1/chat/completions", json=body)
                    answer.raise_for_status()
                    return int(answer.json()["usage"]["completion_tokens"])

                ask("Hi", 8)
                rates = []
                for text in prompts:
                    started = time.perf_counter()
                    tokens = ask(text, 64)
                    rates.append(tokens / (time.perf_counter() - started))
                return rates
        finally:
            loop.run(server.stop())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-python",
        type=Path,
        default=None,
        help="run llama.cpp in this Python's llama-cpp-python (default: make llama's server)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    from libs.models.shipped import gguf_path

    gguf = gguf_path()
    prompts = list(PROMPTS) * args.rounds
    ours = shard_engine_rates(prompts)
    if args.llama_python is None:
        llama = llama_server_rates(prompts)
    else:
        out = subprocess.run(
            [str(args.llama_python), "-c", LLAMA, str(gguf), json.dumps(prompts)],
            check=True,
            capture_output=True,
            text=True,
        )
        llama = json.loads(out.stdout.strip().splitlines()[-1])
    report = {
        "llama_cpp_as": "llama-cpp-python" if args.llama_python else "llama-server",
        "int8_shard_engine_tok_s": round(statistics.median(ours), 1),
        "llama_cpp_tok_s": round(statistics.median(llama), 1),
        "gguf": gguf.name,
        "runs": len(prompts),
    }
    report["ratio_int8_llama"] = round(
        report["int8_shard_engine_tok_s"] / report["llama_cpp_tok_s"], 2
    )
    write_report(
        args.results,
        "engines",
        "One stream: the int8 shard engine against llama.cpp",
        table(report),
    )
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
