"""llama.cpp as an engine: ``llama-server`` runs a deployment, ``ggml-rpc-server`` lends a device.

A split across devices is llama.cpp's RPC backend driven by Tessera's placement: the first
shard's worker runs ``llama-server`` on the GGUF as shipped, keeps its own layers on its CPU, and
offloads the rest to the RPC servers of the other shards' devices, each given exactly the layers
the placement chose (``--n-gpu-layers`` counts the offloaded layers, which llama.cpp takes from
the end; ``--tensor-split`` divides them in route order). Every llamacpp worker runs one
``ggml-rpc-server`` for as long as it lives and announces its address (``rpc_endpoint``).

The binaries come from ``make llama`` (``deploy/build_llama.sh``) in ``.llama/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

from libs.contracts import Prompt, Sampling, ShardTask
from libs.runtime.pki import Credentials
from libs.runtime.procs import child_kwargs, free_port, port_free
from services.worker.chat_templates import tool_template
from services.worker.engine_server import (
    EngineError,
    EngineServer,
    Piece,
    engine_env,
    stop_process,
)
from services.worker.llama_prompts import PromptRefused, Reply, replies
from services.worker.rpc_cache import rpc_cache_dir, trim
from services.worker.rpc_channel import (
    LOOPBACK,
    ChannelError,
    Listener,
    Relay,
    close_all,
    is_loopback,
    listener,
    listening,
    open_tunnels,
)

log = logging.getLogger(__name__)

FINISH = {"eos": "stop", "word": "stop", "limit": "length"}

#: How long (spin iterations) an OpenMP thread of llama.cpp busy-waits for the next work before
#: it sleeps. libgomp's default, 300,000, keeps an idle thread spinning for milliseconds after
#: every graph: a split's stages then spin on the cores the stage at work needs (on one host),
#: and so do the worker, gateway and NATS beside them. 10,000 still spans the barriers inside a
#: graph (OMP_WAIT_POLICY=passive, which sleeps at each, cut one stream to a third). On 2
#: cores, 8 streams, llama-server direct split in 2: 130–145 → 170–183 tokens/s; through
#: Tessera, 0.63 → 0.84 × the whole model (bench/results/serving.md).
SPIN_COUNT = "10000"


def llama_env() -> dict[str, str]:
    """The environment of llama.cpp's processes (a ``GOMP_SPINCOUNT`` already set is kept)."""
    env = engine_env()
    env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    return env


def layer_split(task: ShardTask, layers: int) -> tuple[int, list[int]]:
    """For the first shard's task of a placement: llama.cpp's ``--n-gpu-layers`` and
    ``--tensor-split`` that give each RPC device exactly its shard's layers.

    llama.cpp offloads the last ``n-gpu-layers`` of the ``layers + 1`` it counts (the output
    layer is the last) and hands them out in proportion to the split: so the head keeps its
    ``layer_end`` layers by offloading ``layers - layer_end + 1``, and the last shard's count
    includes the output layer (the last shard computes the logits, as in the torch ring)."""
    if task.shard_index != 0:
        raise ValueError("only the first shard runs llama-server")
    spans = list(task.spans) if task.spans else [(task.layer_start, task.layer_end)]
    if spans[0][0] != 0 or spans[-1][1] != layers:
        raise ValueError(f"the shards cover layers {spans[0][0]}..{spans[-1][1]}, not 0..{layers}")
    counts = [end - start for start, end in spans[1:]]
    if not counts:
        return 0, []
    counts[-1] += 1  # the output layer
    return sum(counts), counts


class LlamaServer(EngineServer):
    engine = "llama.cpp"
    death_signal = signal.SIGKILL  # its SIGTERM waits on open streams: one hung, orphaned
    keep_alive = False

    def __init__(
        self,
        binaries: Path,
        gguf: Path,
        task: ShardTask,
        layers: int,
        *,
        threads: int,
        slots: int = 8,
        context: int = 1024,
        credentials: Credentials | None = None,
    ) -> None:
        """``credentials``: this device's cluster certificate, to reach other hosts' RPC
        servers through TLS tunnels (``rpc_channel``); without them only loopback ones."""
        super().__init__()
        self.binaries, self.gguf, self.task, self.layers = binaries, gguf, task, layers
        self.threads, self.slots, self.context = threads, slots, context
        #: Whether the server honours ``tools`` (the chat template has a tool-call format),
        #: and the template file it is given (None: the GGUF's own), read in ``_start``.
        self.tools = False
        self.template: tuple[Path | None, bool] = (None, False)
        self.credentials = credentials
        #: What ``--rpc`` names for the other shards' RPC servers: a tunnel's loopback address
        #: for each on another host (opened in ``_start``), the endpoint itself on this one.
        self.rpc_addresses: list[str] = list(task.endpoints[1:])
        self.tunnels: list[Relay] = []

    def check(self) -> None:
        if not (self.binaries / "llama-server").exists():
            raise EngineError(f"{self.binaries}/llama-server not found: build it with `make llama`")
        if self.task.shard_count > 1 and len(self.task.endpoints) != self.task.shard_count:
            raise EngineError(
                f"shard 1 of {self.task.shard_count} needs the RPC address of every device of "
                f"{', '.join(self.task.route)}: a device of that route runs no llamacpp worker"
            )

    def command(self) -> tuple[list[str], dict[str, str]]:
        offloaded, split = layer_split(self.task, self.layers)
        command = [
            str(self.binaries / "llama-server"),
            *("-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(self.threads), "-np", str(self.slots)),
            # A KV cache of its own per request slot: with one cache shared by all, a request's
            # attention runs over the others' entries too (masked), its sums round with the
            # batch, and greedy tokens flip at near-ties; apart, a batched request's tokens
            # are its lone run's (tests/integration/test_llamacpp_worker.py).
            *(
                "-c",
                str(self.slots * (self.task.context_length or self.context)),
                "--no-kv-unified",
            ),
            *("--no-webui", "--no-warmup"),
            # The GGUF's own chat template and tool-call format for ``Prompt`` requests, and
            # embeddings (mean-pooled) beside generation: the server switches per batch.
            *("--jinja", "--embeddings", "--pooling", "mean"),
        ]
        template, self.tools = self.template
        if template is not None:  # the model's ChatML template, with a tool-call format
            command += ["--chat-template-file", str(template)]
        if split:
            command += [
                *("--rpc", ",".join(self.rpc_addresses)),
                *("-ngl", str(offloaded), "-ts", ",".join(str(n) for n in split)),
            ]
        else:
            command += ["-ngl", "0", "--device", "none"]
        return command, llama_env()

    async def _start(self, timeout_s: float) -> float:
        """The tunnels to the other hosts' RPC servers first, then llama-server on them."""
        # Reading the GGUF's template takes seconds on a busy host: not on the event loop.
        self.template = await asyncio.to_thread(tool_template, self.gguf)
        if self.task.shard_count > 1:
            try:
                self.rpc_addresses, self.tunnels = await open_tunnels(
                    self.credentials, self.task.endpoints[1:], self.task.route[1:]
                )
            except ChannelError as exc:
                raise EngineError(str(exc)) from exc
        return await super()._start(timeout_s)

    async def stop(self) -> None:
        await super().stop()
        tunnels, self.tunnels = self.tunnels, []
        await close_all(tunnels)

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int
    ) -> AsyncIterator[Piece]:
        if self.http is None:
            raise EngineError("llama-server is not running")
        body: dict[str, object] = {
            "prompt": list(prompt_ids),
            "n_predict": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop),
            "stream": True,
            "return_tokens": True,
            # A slot reuses the KV of the prefix it shares with its last prompt (the chat
            # template's): with a cache per slot, the tokens stay those of a fresh run.
            "cache_prompt": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        async with self.http.stream("POST", "/completion", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise EngineError(f"llama-server answered {response.status_code}: {detail[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise EngineError(f"llama-server: {event['error']}")
                done = bool(event.get("stop"))
                reason = FINISH.get(event.get("stop_type", ""), "stop") if done else None
                tokens = tuple(int(t) for t in event.get("tokens") or ())
                yield Piece(tokens, event.get("content") or "", reason)

    def answer(self, prompt: Prompt, sampling: Sampling) -> AsyncIterator[Reply]:
        """Stream a ``Prompt`` request's answer (``llama_prompts``: the model's own template)."""
        if self.http is None:
            raise EngineError("llama-server is not running")
        if "tools" in prompt.fields and not self.tools:
            reason = "tools: this model's chat template has no tool-call format"
            raise PromptRefused(reason, field="tools")
        return replies(self.http, prompt, sampling)


#: What this host's RPC tensor cache may hold (``TESSERA_WORKER_RPC_CACHE_GB``).
DEFAULT_CACHE_BYTES = 20 * 10**9


class RpcServer:
    """This device's ``ggml-rpc-server``: its CPU, lent to the llama-server of a placement.

    The server itself listens on 127.0.0.1 only. Lent to other hosts (``host`` not loopback),
    it is reached through a mutual-TLS listener on ``host:port`` that lets in only peers with
    a certificate of the cluster's CA naming a head it lends to (``lend_to``; none at first:
    ``services/worker/rpc_channel.py``): ``credentials``, this device's own, are then
    required. The announced ``endpoint`` is that listener's."""

    def __init__(
        self,
        binaries: Path,
        host: str,
        port: int = 0,
        threads: int = 1,
        credentials: Credentials | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.binaries, self.host, self.threads = binaries, host, threads
        self.credentials, self.cache_bytes = credentials, cache_bytes
        self.port = port or free_port(host)
        while not port and not is_loopback(host) and not port_free(LOOPBACK, self.port):
            self.port = free_port(host)
        #: The server's own port, on loopback: the TLS listener's number, so that a head on
        #: this same host reaches it there directly (``rpc_channel.open_tunnels``).
        self.local_port = self.port
        self.proc: asyncio.subprocess.Process | None = None
        self.listener: Listener | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> None:
        binary = self.binaries / "ggml-rpc-server"
        if not binary.exists():
            raise EngineError(f"{binary} not found: build it with `make llama`")
        if not is_loopback(self.host) and self.credentials is None:
            raise EngineError(
                f"llama.cpp's RPC server would be reachable on {self.host} without "
                "authentication: it needs this device's cluster certificate (tessera join)"
            )
        await asyncio.to_thread(trim, rpc_cache_dir(), self.cache_bytes)
        command = [
            *(str(binary), "-H", LOOPBACK, "-p", str(self.local_port), "-t", str(self.threads)),
            # Keep received tensors in a file cache by hash (under LLAMA_CACHE): a head that
            # places the same model here again sends hashes, not weights (tensors over 10 MiB);
            # the least recently used are removed before a start beyond ``cache_bytes``.
            "-c",
        ]
        self.proc = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**llama_env(), "LLAMA_CACHE": str(rpc_cache_dir())},
            **child_kwargs(signal.SIGKILL),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise EngineError(f"ggml-rpc-server exited with {self.proc.returncode}")
            if listening(self.local_port):
                break
            await asyncio.sleep(0.1)
        else:
            await self.stop()
            raise EngineError(
                f"ggml-rpc-server did not listen on {self.local_port} in {timeout_s} s"
            )
        if self.credentials is not None and not is_loopback(self.host):
            try:
                relay = listener(self.credentials, self.host, self.port, self.local_port)
                self.listener = await relay.start(timeout_s)
            except ChannelError as exc:
                await self.stop()
                raise EngineError(f"the RPC server's TLS listener: {exc}") from exc
        log.info("rpc server up", extra={"endpoint": self.endpoint, "tls": bool(self.listener)})

    async def lend_to(self, heads: Iterable[str]) -> None:
        """Let only these devices (the heads of the placements it lends to) through the TLS
        listener from now on; a head no longer named loses its connections."""
        if self.listener is not None:
            await self.listener.admit(heads)

    async def stop(self) -> None:
        relay, self.listener = self.listener, None
        if relay is not None:
            await relay.stop()
        proc, self.proc = self.proc, None
        await stop_process(proc, 5.0)
