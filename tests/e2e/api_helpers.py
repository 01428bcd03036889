"""What the API tests (``test_apis.py``) share: the tools and schemas they ask with, and how
they read a stream's tool calls, the gateway's request counter and the spans written."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(client: Any, content: Any, **kw: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The tool calls of an OpenAI stream, gathered as the client's docs gather them."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            name, args = calls.setdefault(delta.index, ["", ""])
            calls[delta.index] = [
                name + (delta.function.name or ""),
                args + (delta.function.arguments or ""),
            ]
        finish = chunk.choices[0].finish_reason or finish
    return [(n, a) for _, (n, a) in sorted(calls.items())], finish


PERSON_CITY = WEATHER["function"]["parameters"]


def requests_counted(base_url: str) -> dict[tuple[str, str], float]:
    """The gateway's request counter by (route, status)."""
    counted: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        if family.name == "tessera_gateway_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["route"], sample.labels["status"])
                    counted[key] = sample.value
    return counted


def traced(
    folder: Path, since: str, names: list[str], timeout_s: float = 15
) -> dict[str, set[str]]:
    """For each server span name (``POST /v1/messages``) begun after ``since`` (ISO time),
    the services with a span in its trace, read from the spans every service writes to
    ``folder`` (``TESSERA_OTLP_ENDPOINT=file://…``); a name not seen maps to nothing."""
    deadline = time.monotonic() + timeout_s
    while True:  # spans are written as they end; a server span ends after its response
        found = []
        for path in folder.glob("*.jsonl"):
            found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        servers = {
            s["name"]: s["context"]["trace_id"]
            for s in found
            if s["kind"] == "SpanKind.SERVER" and s["start_time"] >= since
        }
        if all(n in servers for n in names) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        name: {
            s["resource"]["attributes"]["service.name"]
            for s in found
            if name in servers and s["context"]["trace_id"] == servers[name]
        }
        for name in names
    }
