"""Steady chat load through the gateway, for the chaos harness, and how each request ended.

``ChatLoad`` sends short greedy requests for one model: ``concurrency`` streaming clients take
the prompts of a run in turn, and each request is counted as ``completed`` (the exact text of
an undisturbed run, ``expected``: nothing missing, nothing repeated), ``failed`` (an error the
client could read), ``corrupt`` (completed with other text) or ``lost`` (no answer at all).
``streams_again`` tells whether a fresh request streams its first token (serving again).

With ``retry_for_s``, each client tries a request again as OpenAI's client does (a refused or
cut connection, 408, 409, 429 or 5xx, and an error event in the stream, which the gateway sends
only for a fault of its own), after 0.5 s doubling to 8 s, for up to ``retry_for_s`` from its
first try; a request that needed more than one try is also counted ``retried``, and its outcome
is its last try's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from typing import Any

import httpx

#: Statuses a client tries again (OpenAI's client's rule), besides every 5xx.
RETRY_STATUSES = frozenset({408, 409, 429})
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0


def load_env(interval_s: float) -> dict[str, str]:
    """The cluster settings both chaos harnesses run under: reports every ``interval_s``, a
    stream whose tokens were lost (nats-server restarting) failing in 10 s, room for the load."""
    return {
        "TESSERA_WORKER_INTERVAL_S": str(interval_s),
        "TESSERA_TELEMETRY_INTERVAL_S": str(interval_s),
        "TESSERA_GATEWAY_STALL_S": "10",
        "TESSERA_GATEWAY_MAX_CONCURRENT": "64",
    }


PROMPTS = ("Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.")


class ChatLoad:
    """Chat requests for ``model`` through the gateway at ``url``, ``max_tokens`` each."""

    def __init__(
        self, url: str, model: str, max_tokens: int, concurrency: int, retry_for_s: float = 0.0
    ) -> None:
        self.url, self.model = url, model
        self.max_tokens, self.concurrency = max_tokens, concurrency
        self.retry_for_s = retry_for_s
        #: Each prompt's answer in an undisturbed run (``learn_answers``).
        self.expected: dict[str, str] = {}

    def learn_answers(self) -> None:
        """Ask each prompt once, undisturbed: what a completed request must stream."""
        self.expected = {p: self.ask(p) for p in PROMPTS}

    def ask(self, prompt: str) -> str:
        """One request without streaming; its answer's text."""
        body = self.body(prompt, stream=False)
        reply = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        reply.raise_for_status()
        return str(reply.json()["choices"][0]["message"]["content"])

    def body(self, prompt: str, stream: bool) -> dict[str, Any]:
        """A greedy chat request for ``prompt``."""
        messages = [{"role": "user", "content": prompt}]
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": stream,
        }

    async def run(self, requests: int, counts: Counter[str], third: threading.Event) -> None:
        """Send ``requests`` streamed requests from ``concurrency`` clients, counting each
        outcome in ``counts``; ``third`` is set once a third of them are done (and at the end)."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(PROMPTS[i % len(PROMPTS)])

        async def client(http: httpx.AsyncClient) -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                counts.update(await self.request(http, prompt))
                if counts.total() - counts["retried"] >= max(1, requests // 3):
                    third.set()

        async with httpx.AsyncClient(timeout=httpx.Timeout(90.0)) as http:
            await asyncio.gather(*(client(http) for _ in range(self.concurrency)))
        third.set()

    async def streams_again(self) -> bool:
        """Serving again: a fresh request streams its first token."""
        body = self.body(PROMPTS[0], stream=True)
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http,
                http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r,
            ):
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        return r.status_code == 200
        except httpx.TransportError:
            pass
        return False

    async def request(self, http: httpx.AsyncClient, prompt: str) -> list[str]:
        """One request, tried again while ``retry_for_s`` allows: its outcome, and
        ``retried`` when it took more than one try."""
        first = time.monotonic()
        pause, tries = RETRY_FIRST_S, 0
        while True:
            tries += 1
            outcome, retryable = await self.stream(http, prompt)
            waited = time.monotonic() - first
            if not retryable or waited + pause > self.retry_for_s:
                return [outcome, "retried"] if tries > 1 else [outcome]
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)

    async def stream(self, http: httpx.AsyncClient, prompt: str) -> tuple[str, bool]:
        """One streamed request's outcome (completed, failed, corrupt or lost), and whether a
        client would try it again."""
        parts: list[str] = []
        finished = False
        try:
            body = self.body(prompt, stream=True)
            async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    json_error = r.headers.get("content-type", "").startswith("application/json")
                    again = r.status_code in RETRY_STATUSES or r.status_code >= 500
                    return ("failed" if json_error else "lost"), again
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed", True
                    for choice in event.get("choices", ()):
                        parts.append(choice.get("delta", {}).get("content") or "")
                        finished = finished or choice.get("finish_reason") is not None
        except httpx.TransportError:
            return "lost", True
        except json.JSONDecodeError:
            return "lost", False
        if not finished:
            return "lost", True
        return ("completed" if "".join(parts) == self.expected[prompt] else "corrupt"), False
