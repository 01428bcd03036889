"""The cost of llama.cpp's RPC channel: a split across two hosts, over mutual TLS and in the clear.

Two hosts on this machine (``libs/harness/lan.py``): this one is the head, running llama-server
with layers 0..14; a network namespace on the same bridge lends its RPC server for layers
15..29 and the output layer. Side by side, on the same two hosts in one run:

- ``plain``: ggml-rpc-server listening on host B's address, reached directly (as before the
  channel: no authentication, no encryption);
- ``channel``: Tessera's ``RpcServer`` on host B (ggml-rpc-server on B's loopback behind a
  socat TLS listener) reached through the head's tunnel (``services/worker/rpc/channel.py``),
  both ends presenting certificates of one cluster CA (``libs/runtime/pki.py``).

Rounds alternate (plain, channel, plain, …) so both see the same machine; each round is one
greedy stream of ``--tokens`` tokens and then ``--streams`` streams at once. Figures: decode
tokens/s per round (after the first token), medians, and channel / plain (goal ≥ 0.9). Both
servers must give the same greedy tokens. Needs root, socat and ``make llama``.

    python bench/rpc_channel.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import add_results_option, table, write_report  # bench/ is the script's folder

from libs.contracts import Sampling, shard_ring
from libs.harness.lan import UNAVAILABLE, Host, lan, lender
from libs.models.shipped import MODEL_NAME, gguf_path
from libs.runtime.pki import ClusterCA, Credentials
from libs.runtime.procs import free_port
from services.worker.rpc.server import llama_env
from services.worker.served.chat_templates import tool_template
from services.worker.served.llama_server import LlamaServer
from services.worker.served.llama_worker import LAYERS
from services.worker.settings import WorkerSettings

BINARIES = WorkerSettings().llama_bin
GOAL = 0.9
#: A prompt that gets a long answer (the chat template's ids are not needed: greedy tokens
#: of any prompt compare the two ways; a story rarely ends early).
PROMPT = "Write a long story about a fox who finds a key in the snow."


class DirectLlamaServer(LlamaServer):
    """llama-server given the RPC endpoints as they are (no tunnels): the plain baseline."""

    async def prepare(self) -> None:
        self.template = await asyncio.to_thread(tool_template, self.gguf)


def plain_lender(host: Host, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """ggml-rpc-server on ``host``'s own address, as every llamacpp worker ran it before."""
    port = free_port()
    command = [str(BINARIES / "ggml-rpc-server"), "-H", host.address, "-p", str(port)]
    proc = subprocess.Popen(
        [*host.prefix, *command, "-t", str(threads)],
        env=llama_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = f"from services.worker.rpc.channel import listening; print(listening({port}))"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        said = subprocess.run(
            [*host.prefix, sys.executable, "-c", probe], capture_output=True, text=True
        )
        if said.stdout.strip() == "True":
            return proc, f"{host.address}:{port}"
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the plain RPC server did not listen")


async def one_stream(
    server: LlamaServer, prompt: list[int], tokens: int
) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy stream (after its first token), and its tokens."""
    times: list[float] = []
    ids: list[int] = []
    async for piece in server.complete(prompt, Sampling(max_tokens=tokens), tokens):
        times.append(time.perf_counter())
        ids.extend(piece.token_ids)
    return (len(times) - 2) / (times[-1] - times[1]), ids


async def streams_at_once(server: LlamaServer, prompt: list[int], tokens: int, n: int) -> float:
    """Aggregate tokens/s of ``n`` greedy streams at once (wall clock, first request on)."""
    started = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(server, prompt, tokens) for _ in range(n)))
    return sum(len(ids) for _, ids in runs) / (time.perf_counter() - started)


async def measure(
    args: argparse.Namespace, plain_endpoint: str, channel_endpoint: str, head: Credentials
) -> dict[str, object]:
    from transformers import AutoTokenizer

    from libs.models.chat import encode_chat
    from libs.models.shipped import prepare

    tokenizer = AutoTokenizer.from_pretrained(prepare())
    prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    shards = [("head-a", 0, 15), ("lender-b", 15, 30)]
    servers: dict[str, LlamaServer] = {}
    for name, endpoint in (("plain", plain_endpoint), ("channel", channel_endpoint)):
        endpoints = ("127.0.0.1:1", endpoint)  # the head's own is not used
        [task] = shard_ring("load", name, MODEL_NAME, shards, 1, 0.0, None, endpoints, 1024)[:1]
        kind = DirectLlamaServer if name == "plain" else LlamaServer
        servers[name] = kind(
            BINARIES, gguf_path(), task, LAYERS, threads=args.threads, credentials=head
        )
    rates: dict[str, dict[str, list[float]]] = {n: {"one": [], "many": []} for n in servers}
    tokens: dict[str, list[int]] = {}
    try:
        for server in servers.values():
            await server.start(180.0)
        for name, server in servers.items():  # warm up: caches, first graphs
            _, tokens[name] = await one_stream(server, prompt, args.tokens)
        for _ in range(args.rounds):
            for name, server in servers.items():
                rate, _ = await one_stream(server, prompt, args.tokens)
                rates[name]["one"].append(rate)
                rates[name]["many"].append(
                    await streams_at_once(server, prompt, args.tokens, args.streams)
                )
    finally:
        for server in servers.values():
            await server.stop()
    medians = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rates.items()}
    ratio = {k: medians["channel"][k] / medians["plain"][k] for k in ("one", "many")}
    return {
        "bench": "rpc_channel",
        "command": " ".join(["python", *sys.argv]),
        "setup": f"head on this host, layers 15..29 + output on a namespace's RPC server; "
        f"{args.threads} thread(s) each; {args.tokens}-token greedy streams",
        "rounds": args.rounds,
        "tokens_per_s": {
            n: {k: [round(x, 1) for x in v] for k, v in r.items()} for n, r in rates.items()
        },
        "median_tokens_per_s": {
            n: {k: round(x, 1) for k, x in m.items()} for n, m in medians.items()
        },
        "ratio_channel_to_plain": {k: round(x, 3) for k, x in ratio.items()},
        "streams_at_once": args.streams,
        "goal": GOAL,
        "goal_met": all(x >= GOAL for x in ratio.values()),
        "same_greedy_tokens": tokens["plain"] == tokens["channel"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    if UNAVAILABLE:
        sys.exit(UNAVAILABLE)
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as tmp, lan(1) as network:
        folder = Path(tmp)
        ca = ClusterCA.create(folder / "ca")
        head = ca.issue(folder / "head", "head-a")
        ca.issue(folder / "lender", "lender-b")
        [host_b] = network.hosts
        proc, plain_endpoint = plain_lender(host_b, args.threads)
        try:
            with lender(host_b, BINARIES, folder / "lender", args.threads, ["head-a"]) as lent:
                result = asyncio.run(measure(args, plain_endpoint, str(lent["endpoint"]), head))
        finally:
            proc.kill()
            proc.wait()
    write_report(
        args.results,
        "rpc_channel",
        "llama.cpp's RPC channel: the cost of mutual TLS",
        table(result),
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
