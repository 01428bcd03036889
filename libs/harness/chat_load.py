"""Steady chat load through the gateway, for the chaos harness, and how each request ended.

``ChatLoad`` sends short greedy requests for one model: ``concurrency`` streaming clients take
the prompts of a run in turn, and each request is counted as ``completed`` (the exact text of
an undisturbed run, ``expected``: nothing missing, nothing repeated), ``failed`` (an error the
client could read), ``corrupt`` (completed with other text) or ``lost`` (no answer at all).
``streams_again`` tells whether a fresh request streams its first token (serving again).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import httpx

PROMPTS = ("Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.")


class ChatLoad:
    """Chat requests for ``model`` through the gateway at ``url``, ``max_tokens`` each."""

    def __init__(self, url: str, model: str, max_tokens: int, concurrency: int) -> None:
        self.url, self.model = url, model
        self.max_tokens, self.concurrency = max_tokens, concurrency
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
                counts[await self.stream(http, prompt)] += 1
                if sum(counts.values()) >= max(1, requests // 3):
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

    async def stream(self, http: httpx.AsyncClient, prompt: str) -> str:
        """One streamed request's outcome: completed, failed, corrupt or lost."""
        parts: list[str] = []
        finished = False
        try:
            body = self.body(prompt, stream=True)
            async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return (
                        "failed"
                        if r.headers.get("content-type", "").startswith("application/json")
                        else "lost"
                    )
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed"
                    for choice in event.get("choices", ()):
                        parts.append(choice.get("delta", {}).get("content") or "")
                        finished = finished or choice.get("finish_reason") is not None
        except (httpx.TransportError, json.JSONDecodeError):
            return "lost"
        if not finished:
            return "lost"
        return "completed" if "".join(parts) == self.expected[prompt] else "corrupt"
