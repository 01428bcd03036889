"""A ``Prompt`` request through llama.cpp's own OpenAI endpoints, as ``Reply`` pieces.

llama-server (started with ``--jinja``) applies the GGUF's chat template and tool-call format,
constrains output with a grammar for tools and JSON schemas, and counts tokens exactly, so a
chat goes to its ``/v1/chat/completions`` and a text completion to ``/v1/completions`` as the
gateway validated them, streamed. Tool calls come back in pieces; they are kept until the
answer ends and sent whole, so a re-run after a migration never leaves half a call with the
user (each of their pieces is an empty ``Reply`` meanwhile). Each other piece (text, its
log-probabilities) is one ``Reply``, in the order the server sent them: the same request and
seed give the same pieces again.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from libs.contracts import Prompt, Sampling, TokenLogprob, ToolCall, TopLogprob
from services.worker.device.processes import EngineError

#: Where each kind of prompt goes.
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


class PromptRefused(EngineError):
    """llama-server refused the request as invalid (a 4xx): the user's to fix, not a failure;
    ``field`` names the request's field at fault where known."""

    def __init__(self, message: str, field: str = "request") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    embedding: tuple[float, ...] = ()
    #: Set on the last reply only, with the exact token counts.
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: On the last reply: the stop sequence that ended the text (None: none did).
    stop_sequence: str | None = None


def request_body(prompt: Prompt, sampling: Sampling) -> dict[str, Any]:
    """The server's request: the user's fields, the sampling the owner fixed (its seed: the
    same on a re-run), streamed with usage."""
    body: dict[str, Any] = json.loads(prompt.body)
    body.update(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        cache_prompt=True,
    )
    body.pop("max_completion_tokens", None)
    body.pop("n", None)  # the gateway runs one request per choice
    if forced(body):
        body["response_format"] = {"type": "json_schema", "json_schema": call_schema(body)}
    if sampling.stop:
        body["stop"] = list(sampling.stop)
        # OpenAI's finish_reason "stop" covers both the end of the turn and a stop word;
        # llama.cpp says which in its own fields, sent (these two alone) on the last event.
        body["verbose"] = True
        body["response_fields"] = ["stop_type", "stopping_word"]
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


def forced(body: dict[str, Any]) -> bool:
    """Whether the request must call a tool (``tool_choice`` required, or named: the gateway
    sends a named one as required with that tool alone)."""
    return bool(body.get("tools")) and body.get("tool_choice") == "required"


def call_schema(body: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema of one call of the request's tools: a forced call is generated as JSON
    under it. llama.cpp's own tool grammar lets a model write text before a call, which a
    small model does until its token limit; this one leaves it nothing but a valid call (the
    template still shows it the tools)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in body["tools"]
    ]
    return {"name": "tool_call", "schema": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def the_call(text: str, number: int) -> ToolCall | None:
    """The forced call a request's JSON answer names (None: cut short, not a whole call)."""
    try:
        found = json.loads(text)
        name, arguments = found["name"], found["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    return ToolCall(id=f"call_{number}", name=str(name), arguments=json.dumps(arguments))


def logprobs_of(choice: dict[str, Any]) -> tuple[TokenLogprob, ...]:
    content = (choice.get("logprobs") or {}).get("content") or ()
    return tuple(
        TokenLogprob(
            token=str(entry.get("token", "")),
            logprob=float(entry.get("logprob", 0.0)),
            bytes=tuple(entry["bytes"]) if entry.get("bytes") is not None else None,
            top=tuple(
                TopLogprob(
                    token=str(top.get("token", "")),
                    logprob=float(top.get("logprob", 0.0)),
                    bytes=tuple(top["bytes"]) if top.get("bytes") is not None else None,
                )
                for top in (entry.get("top_logprobs") or ())[:20]
            ),
        )
        for entry in content
    )


@dataclass
class Calls:
    """Tool-call pieces gathered by index until the answer ends."""

    parts: dict[int, dict[str, str]] = field(default_factory=dict)

    def add(self, delta: dict[str, Any]) -> None:
        part = self.parts.setdefault(int(delta.get("index", 0)), {"id": "", "name": "", "args": ""})
        function = delta.get("function") or {}
        part["id"] = delta.get("id") or part["id"]
        name = function.get("name") or ""
        # Sent once whole, or in pieces: a repeat of the whole name replaces it.
        part["name"] = (
            name if name.startswith(part["name"]) and part["name"] else part["name"] + name
        )
        part["args"] += function.get("arguments") or ""

    def whole(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(id=p["id"] or f"call_{i}", name=p["name"], arguments=p["args"])
            for i, p in sorted(self.parts.items())
        )


async def embeddings(http: httpx.AsyncClient, prompt: Prompt) -> AsyncIterator[Reply]:
    """An embeddings request: a reply per input with its vector, then the token count."""
    body = json.loads(prompt.body)
    response = await http.post("/v1/embeddings", json={"input": body["input"]})
    if response.status_code != 200:
        message = _message(response.text)
        if 400 <= response.status_code < 500:
            raise PromptRefused(message)
        raise EngineError(f"llama-server answered {response.status_code}: {message}")
    answer = response.json()
    for row in sorted(answer.get("data") or (), key=lambda r: int(r.get("index", 0))):
        yield Reply(embedding=tuple(float(x) for x in row["embedding"]))
    tokens = (answer.get("usage") or {}).get("prompt_tokens")
    yield Reply(finish_reason="stop", prompt_tokens=tokens, completion_tokens=0)


async def replies(
    http: httpx.AsyncClient, prompt: Prompt, sampling: Sampling
) -> AsyncIterator[Reply]:
    """Stream ``prompt``'s answer; ``PromptRefused`` when the server finds it invalid."""
    if prompt.kind == "embed":
        async for reply in embeddings(http, prompt):
            yield reply
        return
    body = request_body(prompt, sampling)
    must_call = forced(body)
    said: list[str] = []  # a forced call's JSON, kept until it is whole
    calls = Calls()
    finish: str | None = None
    stop_word: str | None = None
    usage: dict[str, Any] = {}
    async with http.stream("POST", PATHS[prompt.kind], json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            with_message = _message(detail)
            if 400 <= response.status_code < 500:
                raise PromptRefused(with_message)
            raise EngineError(f"llama-server answered {response.status_code}: {with_message}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise EngineError(f"llama-server: {_message(json.dumps(event))}")
            usage = event.get("usage") or usage
            stop_word = stopping_word(event) or stop_word
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or ():
                    calls.add(call)
                text = delta.get("content") if prompt.kind == "chat" else choice.get("text")
                logprobs = logprobs_of(choice)
                if must_call and text:
                    said.append(text)
                    text = ""
                    logprobs = ()
                    yield Reply()
                elif text or logprobs or delta.get("tool_calls"):
                    # A tool call's piece is kept; an empty reply stands for it, so the
                    # pieces are counted the same on a re-run and the user's stream starts.
                    yield Reply(text=text or "", logprobs=logprobs)
                finish = choice.get("finish_reason") or finish
    if must_call:
        call = the_call("".join(said), sampling.seed or 0)
        if call is not None:
            calls.parts.clear()
            finish = "tool_calls"
            yield Reply(tool_calls=(call,))
        elif said:
            yield Reply(text="".join(said))  # cut short (its limit): the text as it is
    if calls.parts:
        yield Reply(tool_calls=calls.whole())
    yield Reply(
        finish_reason=finish or "stop",
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        stop_sequence=stop_word if (finish or "stop") == "stop" else None,
    )


def stopping_word(event: dict[str, Any]) -> str | None:
    """The stop sequence that ended the text, from llama.cpp's own fields of an event
    (``__verbose``, sent when the request has stop sequences); None when none did."""
    native = event.get("__verbose")
    if not isinstance(native, dict) or native.get("stop_type") != "word":
        return None
    word = native.get("stopping_word")
    return str(word)[:256] if word else None


def _message(detail: str) -> str:
    try:
        error = json.loads(detail).get("error")
    except (ValueError, AttributeError):
        return detail[:1500]
    if isinstance(error, dict):
        return str(error.get("message", error))[:1500]
    return str(error)[:1500]
