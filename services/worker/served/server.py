"""An inference engine run as its own process and spoken to over HTTP (vLLM, llama.cpp's server).

``EngineServer`` starts the process on a free port with its output in a log file, waits until
its health endpoint answers and then until it answers a first one-token request (up is not
serving: the first forward pass takes from a second to a minute), and stops it. Each engine
implements its hooks once: the command, what it readies before the process starts and releases
after it stopped, a check that it can run here, and a completion of token ids as ``Piece``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from libs.contracts import Prompt, Sampling
from libs.runtime.procs import child_kwargs, free_port
from services.worker.device.processes import EngineError, stop_process

log = logging.getLogger(__name__)
#: How often a starting server is asked whether it is up. A re-placed deployment serves, and
#: its re-run requests start, only once it is: at 0.2 s the wait past the moment it listened
#: was 0.1 s on average (llama-server listens about 0.45 s after it starts here), part of
#: worker_kill's recovery (bench/chaos.py). A refused connection costs next to nothing.
HEALTH_POLL_S = 0.02


@dataclass(frozen=True)
class Piece:
    """One streamed event: the new token ids and their text, or the reason it ended."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    #: The stop sequence that ended it, where the engine names one.
    stop_sequence: str | None = None


class EngineServer(ABC):
    #: The engine's name in messages, and the path that answers 200 once it is up.
    engine = "engine"
    health_path = "/health"
    #: What the server gets when the worker dies without stopping it.
    death_signal: int = signal.SIGTERM
    #: Whether a connection is reused for the next request (llama.cpp's server drops some
    #: between requests without a word: the next request on it failed, 3 in 40 here).
    keep_alive = True

    def __init__(self) -> None:
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path: Path | None = None
        self.http: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @abstractmethod
    def command(self) -> tuple[list[str], dict[str, str]]:
        """The command line (listening on ``self.port``) and its environment."""

    @abstractmethod
    def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int
    ) -> AsyncIterator[Piece]:
        """Stream one completion of ``prompt_ids``; closing the iterator aborts it."""

    @abstractmethod
    def check(self) -> None:
        """Raise ``EngineError`` when the engine cannot start here (its build is missing)."""

    @abstractmethod
    async def prepare(self) -> None:
        """Ready what the process needs before it starts (not counted in its start time);
        raise ``EngineError`` when it cannot. Undone by ``release``."""

    @abstractmethod
    async def release(self) -> None:
        """Release what ``prepare`` readied, once the process stopped (called by ``stop``,
        also after a start that failed, so whatever part of it was readied)."""

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...] | None:
        """A prompt's token ids by the model's own tokenizer, for a request the gateway sent
        without them (it has no tokenizer for the model); None: this engine does not say."""
        return None

    async def start(self, timeout_s: float = 300.0) -> float:
        """Start the server and wait until it answers a request; returns the seconds it took
        (on failure, it is stopped and ``EngineError`` says why)."""
        self.check()
        try:
            await self.prepare()
            return await self._launch(timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def _launch(self, timeout_s: float) -> float:
        started = time.monotonic()
        self.port = free_port()
        command, env = self.command()
        prefix = f"{self.engine.replace('.', '')}-"
        with tempfile.NamedTemporaryFile("wb", prefix=prefix, suffix=".log", delete=False) as f:
            self.log_path = Path(f.name)
        with self.log_path.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *command,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                **child_kwargs(self.death_signal),
            )
        log.info(f"starting {self.engine}", extra={"port": self.port, "log": str(self.log_path)})
        self.http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(30.0, read=None),
            limits=httpx.Limits(max_keepalive_connections=20 if self.keep_alive else 0),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise EngineError(
                    f"{self.engine} exited with {self.proc.returncode}: {self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get(self.health_path, timeout=2.0)).status_code == 200:
                    break
            await asyncio.sleep(HEALTH_POLL_S)
        else:
            raise EngineError(
                f"{self.engine} did not answer within {timeout_s:.0f} s: {self.tail()}"
            )
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                async for _ in self.complete([0], Sampling(max_tokens=1), 1):
                    pass
        except (TimeoutError, httpx.HTTPError, EngineError) as exc:
            message = f"{self.engine} did not answer a first request: {exc!r} {self.tail()}"
            raise EngineError(message) from exc
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
        await stop_process(proc, 20.0)
        await self.release()
