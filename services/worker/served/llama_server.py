"""llama.cpp's ``llama-server`` as an engine: it runs a deployment, on the placement's devices.

A split across devices is llama.cpp's RPC backend driven by Tessera's placement: the first
shard's worker runs ``llama-server`` on the GGUF as shipped, keeps its own layers on its CPU, and
offloads the rest to the RPC servers of the other shards' devices (``services/worker/rpc/``),
each given exactly the layers the placement chose (``--n-gpu-layers`` counts the offloaded
layers, which llama.cpp takes from the end; ``--tensor-split`` divides them in route order).

The binaries come from ``make llama`` (``deploy/build_llama.sh``) in ``.llama/``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from libs.contracts import Prompt, Sampling, ShardTask
from libs.runtime.pki import Credentials
from services.worker.device.processes import EngineError
from services.worker.rpc.channel import ChannelError, Relay, close_all, open_tunnels
from services.worker.rpc.server import llama_env
from services.worker.served.chat_templates import tool_template
from services.worker.served.llama_prompts import PromptRefused, Reply, replies
from services.worker.served.server import EngineServer, Piece

log = logging.getLogger(__name__)

FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


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


#: Of a GPU's memory, what this device announces for a model's layers and their KV cache (the
#: rest: CUDA's own buffers and the compute graph's); the placement counts within it.
GPU_SHARE = 0.8


def gpu_command(task: ShardTask, offloaded: int, split: Sequence[int]) -> list[str]:
    """llama-server's offload flags where the placement put layers on GPUs (``gpu_spans``):
    for a whole model, ``task.gpu_layers`` of its ``layers + 1``; for a split, every device
    named in pipeline order (RPC servers come first by default): the head's GPU for its own
    last layers, then each RPC server's one device (its CPU), or two for a GPU host's (its
    CPU for the shard's first layers, its GPU for the last: ``RpcServer(gpu=True)``), each
    given its layers in ``--tensor-split``."""
    if not split:
        return ["-ngl", str(task.gpu_layers)]
    devices, counts, n = [], [], 0
    if task.gpu_layers:
        devices, counts = ["CUDA0"], [task.gpu_layers]
    spans = task.gpu_spans or (None,) * task.shard_count
    for count, on_gpu in zip(split, spans[1:], strict=True):
        parts = [count] if on_gpu is None else [count - on_gpu, on_gpu]
        devices += [f"RPC{n + i}" for i in range(len(parts))]  # in --rpc order
        counts += parts
        n += len(parts)
    return [
        *("--device", ",".join(devices)),
        *("-ngl", str(offloaded + task.gpu_layers)),
        *("-ts", ",".join(str(c) for c in counts)),
    ]


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
        servers through TLS tunnels (``services/worker/rpc/channel.py``); without them only
        loopback ones. The task's ``gpu_layers`` go to this host's GPU (llama.cpp built with
        CUDA: the device announced its VRAM), the rest of its layers stay on the CPU."""
        super().__init__()
        self.binaries, self.gguf, self.task, self.layers = binaries, gguf, task, layers
        self.threads, self.slots, self.context = threads, slots, context
        #: Whether the server honours ``tools`` (the chat template has a tool-call format),
        #: and the template file it is given (None: the GGUF's own), read in ``prepare``.
        self.tools = False
        self.template: tuple[Path | None, bool] = (None, False)
        self.credentials = credentials
        #: What ``--rpc`` names for the other shards' RPC servers: a tunnel's loopback address
        #: for each on another host (opened in ``prepare``), the endpoint itself on this one.
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
        if split:  # the RPC servers first: --device names them
            command += ["--rpc", ",".join(self.rpc_addresses)]
        if self.task.gpu_spans:  # a device of the route serves layers from its GPU
            gpu = self.task.gpu_layers > 0
            return [*command, *gpu_command(self.task, offloaded, split)], llama_env(gpu=gpu)
        if split:
            command += ["-ngl", str(offloaded), "-ts", ",".join(str(n) for n in split)]
            return command, llama_env()
        return [*command, "-ngl", "0", "--device", "none"], llama_env()

    async def prepare(self) -> None:
        """The GGUF's chat template read, and the tunnels to the other hosts' RPC servers
        opened: llama-server starts on them."""
        # Reading the GGUF's template takes seconds on a busy host: not on the event loop.
        self.template = await asyncio.to_thread(tool_template, self.gguf)
        if self.task.shard_count > 1:
            try:
                self.rpc_addresses, self.tunnels = await open_tunnels(
                    self.credentials, self.task.endpoints[1:], self.task.route[1:]
                )
            except ChannelError as exc:
                raise EngineError(str(exc)) from exc

    async def release(self) -> None:
        """The tunnels closed (llama-server, their one user, has stopped)."""
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
