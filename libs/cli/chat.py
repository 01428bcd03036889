"""``tessera chat``: a tiny terminal client of the gateway's OpenAI API (streams the reply)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from rich.console import Console

from libs.cluster import runfile


def gateway_url(explicit: str | None, run_file: Path) -> str:
    if explicit:
        return explicit.rstrip("/")
    return str(runfile.read(run_file)["gateway_url"])


def reply(
    http: httpx.Client, url: str, model: str, history: list[dict[str, str]], max_tokens: int
) -> str:
    """Stream one assistant turn to the terminal; returns its text."""
    console = Console(highlight=False)
    body = {"model": model, "messages": history, "stream": True, "max_tokens": max_tokens}
    parts: list[str] = []
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            message = response.json().get("error", {}).get("message", response.text)
            raise SystemExit(f"error {response.status_code}: {message}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"error: {event['error'].get('message')}")
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                parts.append(text)
                console.print(text, end="", soft_wrap=True)
    console.print()
    return "".join(parts)


def chat(url: str, model: str, api_key: str | None, max_tokens: int, once: str | None) -> None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    history: list[dict[str, str]] = []
    with httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=120.0)) as http:
        while True:
            if once is not None:
                prompt = once
            else:
                try:
                    prompt = input("you> ").strip()
                except EOFError:
                    return
                if not prompt:
                    continue
            history.append({"role": "user", "content": prompt})
            history.append(
                {"role": "assistant", "content": reply(http, url, model, history, max_tokens)}
            )
            if once is not None:
                return
