"""One stream, in one process: the int8 shard engine against llama.cpp on the same model.

The figure behind the engines' choice (docs/getting-started.md). Each runs SmolLM2-135M-Instruct
whole in this machine's process with 2 threads, 64-token greedy chat completions of the same
prompts, one after another (no gateway, no batching: llama-cpp-python's API runs one sequence
at a time). llama.cpp is not a dependency (it needs a source build, ~4.5 min, see
docs/getting-started.md): give the Python of a virtualenv that has ``llama-cpp-python``.

    python bench/engines.py --llama-python /tmp/llama-venv/bin/python --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from libs.models.shipped import gguf_path

    gguf = gguf_path()
    prompts = list(PROMPTS) * args.rounds
    ours = shard_engine_rates(prompts)
    out = subprocess.run(
        [str(args.llama_python), "-c", LLAMA, str(gguf), json.dumps(prompts)],
        check=True,
        capture_output=True,
        text=True,
    )
    llama = json.loads(out.stdout.strip().splitlines()[-1])
    report = {
        "int8_shard_engine_tok_s": round(statistics.median(ours), 1),
        "llama_cpp_tok_s": round(statistics.median(llama), 1),
        "gguf": gguf.name,
        "runs": len(prompts),
    }
    report["ratio_int8_llama"] = round(
        report["int8_shard_engine_tok_s"] / report["llama_cpp_tok_s"], 2
    )
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
