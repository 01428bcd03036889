"""Serving side by side: Tessera split across its CPU workers, Tessera whole on one, vLLM direct.

Starts the systems at once on this machine and measures them in turn (the order rotates each
round, so drift and the idle systems' background load fall on all alike):

- ``tessera_split``: ``tessera up`` as ``make up`` starts it (its CPU workers' engine:
  llama.cpp where ``make llama`` built it, else torch; ``--engine`` picks), each worker given
  the memory that splits SmolLM2 across its 2 CPU workers (0.55 GB for torch, where it counts
  0.48 GB at int8 with its KV cache; 0.75 GB for llama.cpp, where it counts 0.72 GB as its
  GGUF with 8 request slots' KV cache);
- ``tessera_whole``: ``tessera up --workers 1`` (the same model whole on one CPU worker);
- ``vllm_direct``: vLLM's CPU build served directly from ``.venv-vllm`` (``make vllm``), bf16;
- ``llamacpp_direct`` (with the llamacpp engine): llama.cpp's server on the whole GGUF, as the
  worker starts it, served directly: ``ratio_whole_llamacpp_direct_*`` is what Tessera's path
  (gateway, placement, NATS, the worker's re-streaming) keeps of the engine's speed.

At each concurrency, that many clients each stream ``--requests`` (4 at one) greedy 64-token chat
completions through the official ``openai`` client; tokens/s is all completion tokens over the
wall time. ``identical_tokens``: each prompt's greedy text split equals whole at concurrency 1.

    python bench/serving.py --json [--rounds 2] [--requests 2] [--levels 1,4,8,16]

Goals: split ≥ 0.7 × vLLM at 8 streams, ≥ 0.8 × at 1; split ≥ 0.8 × whole at 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from openai import AsyncOpenAI
from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.cluster.engine_choice import choose_cpu_engine
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.procs import ServiceProcess, free_port
from services.worker.served.llama_worker import server_factory, whole_task
from services.worker.served.server import EngineServer
from services.worker.served.vllm_server import VllmServer
from services.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "List four animals that live in the ocean.",
    "What is a prime number?",
    "Describe a rainy morning in a city.",
    "How do plants make their food?",
    "Suggest a name for a small bakery.",
    "What does a compiler do?",
    "Tell me a fact about the Moon.",
    "How many days are in a leap year, and why?",
    "Write a haiku about autumn.",
    "What is the difference between weather and climate?",
)


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


#: Each system's column and the prefix of its TTFT columns.
PREFIXES = {
    "tessera_split": "",
    "tessera_whole": "whole_",
    "vllm_direct": "direct_",
    "llamacpp_direct": "llamacpp_",
}


def llama_direct() -> EngineServer:
    """llama.cpp's server on the whole GGUF, as the llamacpp worker runs it, served directly."""
    return server_factory(WorkerSettings())(whole_task("direct", "direct"))


def start_cluster(
    workers: int | None, memory_gb: str | None, engine: str
) -> tuple[ServiceProcess, str]:
    port = free_port()
    env = {
        **({"TESSERA_WORKER_MEMORY_GB": memory_gb} if memory_gb else {}),
        "TESSERA_CPU_ENGINE": engine,
        "TESSERA_GATEWAY_PORT": str(port),
        "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
        "TESSERA_RUN_FILE": str(Path(tempfile.mkdtemp()) / "cluster.json"),
        "TESSERA_HOME": tempfile.mkdtemp(prefix="tessera-home-"),  # a new cluster each run
    }
    argv = ["-m", "libs.cli.main", "up"] + ([] if workers is None else ["--workers", str(workers)])
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    child = ServiceProcess("tessera up", env, argv, ready_line=ready).start(ready_timeout_s=300)
    return child, f"http://127.0.0.1:{port}/v1"


def placement(child: ServiceProcess) -> str:
    """The launcher's "deployed MODEL on DEVICES" line (after its "cluster │" prefix)."""
    lines = [str(line.get("msg", line)) for line in child.lines]
    found = (re.search(r"deployed \S+ on .*", line) for line in lines)
    return next((m.group(0) for m in found if m), "not deployed")


async def one(
    client: AsyncOpenAI, model: str, text: str, max_tokens: int
) -> tuple[int, float, str]:
    """One streamed greedy completion: (completion tokens, TTFT s, text)."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                parts.append(choice.delta.content)
    return tokens, (first or time.perf_counter()) - started, "".join(parts)


async def measure(client: AsyncOpenAI, model: str, concurrency: int, requests: int) -> Result:
    result = Result()

    async def stream_client(k: int) -> None:
        for r in range(requests):
            text = PROMPTS[(k * requests + r) % len(PROMPTS)]
            tokens, ttft, out = await one(client, model, text, 64)
            result.tokens += tokens
            result.ttft.append(ttft)
            result.texts[text] = out

    started = time.perf_counter()
    await asyncio.gather(*(stream_client(k) for k in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> dict[str, object]:
    levels = [int(x) for x in args.levels.split(",")]
    vllm = VllmServer(
        REPO / ".venv-vllm" / "bin" / "python", prepare(), MODEL_NAME, dtype="bfloat16"
    )
    started = time.monotonic()
    # At int8 the model (0.48 GB with its KV cache) fits one emulated workstation, and the
    # scheduler places it whole; 0.55 GB per worker (0.44 usable) makes it split across both.
    # llama.cpp's GGUF with 8 slots' f16 KV cache counts 0.72 GB whole, 0.50 a half: 0.75 GB.
    engine = choose_cpu_engine(args.engine)[0]
    split, split_url = start_cluster(None, "0.75" if engine == "llamacpp" else "0.55", engine)
    try:
        whole, whole_url = start_cluster(1, None, engine)
    except RuntimeError:
        split.stop(timeout_s=30)  # nothing left running by a benchmark that failed
        raise
    await vllm.start()
    servers: list[EngineServer] = [vllm]
    urls = {"tessera_split": split_url, "tessera_whole": whole_url, "vllm_direct": f"{vllm.url}/v1"}
    if engine == "llamacpp":  # the engine itself, served directly: what Tessera's path costs
        llama = llama_direct()
        await llama.start()
        servers.append(llama)
        urls["llamacpp_direct"] = f"{llama.url}/v1"
    setup_s = time.monotonic() - started
    clients = {
        name: AsyncOpenAI(base_url=url, api_key="none", timeout=300) for name, url in urls.items()
    }
    results: dict[tuple[str, int], list[Result]] = {}
    try:
        for client in clients.values():  # warm-up: first requests load tokenizers and kernels
            await measure(client, MODEL_NAME, 2, 1)
        names = list(clients)
        for round_index in range(args.rounds):
            for level in levels:
                shift = (round_index + levels.index(level)) % len(names)
                for name in names[shift:] + names[:shift]:
                    print(f"round {round_index + 1} c={level} {name}", file=sys.stderr)
                    count = args.requests if level > 1 else max(4, args.requests)
                    result = await measure(clients[name], MODEL_NAME, level, count)
                    results.setdefault((name, level), []).append(result)
        report = summarise(results, levels)
        report["engine"] = engine
        report["placement_split"] = placement(split)
        report["placement_whole"] = placement(whole)
        report["setup_s"] = round(setup_s, 1)
        return report
    finally:
        split.stop(timeout_s=30)
        whole.stop(timeout_s=30)
        for server in servers:
            await server.stop()


def summarise(results: dict[tuple[str, int], list[Result]], levels: list[int]) -> dict[str, object]:
    table: dict[str, dict[str, float]] = {}
    for level in levels:
        row: dict[str, float] = {}
        for name, prefix in PREFIXES.items():
            if (name, level) not in results:
                continue
            runs = results[(name, level)]
            row[name] = round(statistics.median(r.rate for r in runs), 1)
            ttft = [t for r in runs for t in r.ttft]
            row[f"{prefix}ttft_p50_s"] = round(quantile(ttft, 0.5), 3)
            row[f"{prefix}ttft_p99_s"] = round(quantile(ttft, 0.99), 3)
        table[str(level)] = row
    split_texts = {t: s for r in results[("tessera_split", levels[0])] for t, s in r.texts.items()}
    whole_texts = {t: s for r in results[("tessera_whole", levels[0])] for t, s in r.texts.items()}
    shared = split_texts.keys() & whole_texts.keys()

    def ratio(a: str, b: str, level: int) -> float | None:
        if str(level) not in table:
            return None
        row = table[str(level)]
        return round(row[a] / row[b], 2) if row.get(b) else None

    return {
        "model": MODEL_NAME,
        "concurrency": table,
        "ratio_split_vllm_c8": ratio("tessera_split", "vllm_direct", 8),
        "ratio_split_vllm_c1": ratio("tessera_split", "vllm_direct", 1),
        "ratio_split_whole_c8": ratio("tessera_split", "tessera_whole", 8),
        "ratio_whole_llamacpp_direct_c1": ratio("tessera_whole", "llamacpp_direct", 1),
        "ratio_whole_llamacpp_direct_c8": ratio("tessera_whole", "llamacpp_direct", 8),
        "identical_tokens": bool(shared) and all(split_texts[t] == whole_texts[t] for t in shared),
        "prompts_compared": len(shared),
    }


def serving_tables(report: dict[str, object]) -> str:
    """The report's tokens/s and TTFT by concurrency (a row per level), then its other figures."""
    levels = report["concurrency"]
    assert isinstance(levels, dict)
    rows = [{"streams": level, **row} for level, row in levels.items()]
    rest = {k: v for k, v in report.items() if k != "concurrency"}
    return f"{table(rows)}\n\n{table(rest)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per level")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument(
        "--engine",
        choices=("torch", "llamacpp"),
        default=None,
        help="the CPU workers' engine (default: as `make up` chooses)",
    )
    add_results_option(parser)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    write_report(args.results, "serving", "Serving results", serving_tables(report))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for level, row in report["concurrency"].items():  # type: ignore[attr-defined]
            print(level, row)
        print({k: v for k, v in report.items() if k != "concurrency"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
