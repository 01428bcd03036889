"""A batch's input file read and checked whole before anything is queued: each line a request
of the batch's endpoint, as OpenAI's Batch API takes it.

A line is ``{"custom_id": …, "method": "POST", "url": <the endpoint>, "body": {…}}``; the body
is checked by the same request model the endpoint's route uses, with ``stream`` refused (a
batch's answers are whole). Every line names the same model. A training job's lines
(``TRAIN_ENDPOINT``) are training runs (``TrainRequest``), trained by the batch workers. The
first fault is raised with its line number (1-based) and cause; a file with none gives every
line, in order.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libs.contracts.batch_requests import TRAIN_ENDPOINT
from services.gateway.anthropic.protocol import MessagesRequest
from services.gateway.openai.embeddings import EmbeddingRequest
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest


class TrainRequest(BaseModel):
    """A training run: ``steps`` of the elastic training job (``services/batch/training.py``,
    the model ``tessera-mlp``), checkpointed every ``every`` steps, drawn by ``seed``."""

    model_config = ConfigDict(extra="forbid")
    model: Literal["tessera-mlp"]
    steps: int = Field(ge=1, le=10_000_000)
    every: int = Field(10, ge=1, le=1_000_000)
    seed: int = Field(0, ge=0, le=2**31 - 1)


#: The endpoints a batch may call, with the request model each one's route checks.
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/messages": MessagesRequest,  # Anthropic's Message Batches
    TRAIN_ENDPOINT: TrainRequest,  # Tessera's training jobs
}
#: Requests one batch may hold (OpenAI's limit).
MAX_LINES = 50_000
#: Tokens a request without ``max_tokens`` is counted for when its time is estimated.
ASSUMED_MAX_TOKENS = 256
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


class LineError(ValueError):
    """A fault of the input file: ``line`` (1-based; 0 for the file as a whole) and the cause."""

    def __init__(self, line: int, message: str) -> None:
        self.line, self.cause = line, message
        super().__init__(f"line {line}: {message}" if line else message)


@dataclass(frozen=True, slots=True)
class BatchLine:
    number: int
    custom_id: str
    body: dict[str, Any]

    @property
    def token_budget(self) -> int:
        """The most tokens it may generate (a training run: its steps), as counted for the
        estimate."""
        for name in ("max_completion_tokens", "max_tokens", "steps"):
            if isinstance(self.body.get(name), int):
                return int(self.body[name])
        return 0 if "input" in self.body else ASSUMED_MAX_TOKENS


def window_seconds(window: str) -> float:
    """``completion_window`` in seconds: ``24h`` as OpenAI has it, and any shorter or other
    span (``90s``, ``30m``, ``2h``, ``1d``)."""
    found = _WINDOW.match(window)
    if not found or float(found[1]) <= 0:
        raise ValueError(f"completion_window {window!r} is not a span such as 24h, 2h, 30m or 90s")
    return float(found[1]) * _UNITS[found[2]]


def read_lines(content: bytes, endpoint: str, max_body_bytes: int = 0) -> list[BatchLine]:
    """Every request of ``content`` (JSONL), or ``LineError`` at the first fault; a request
    body over ``max_body_bytes`` (the gateway's limit, when given) is one."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(0, f"the file is not UTF-8 text (byte {exc.start})") from None
    model_type = ENDPOINTS[endpoint]
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    model: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _one(number, raw, endpoint, model_type)
        size = len(json.dumps(line.body).encode())
        if max_body_bytes and size > max_body_bytes:
            message = f"body of {size} bytes: a request may be {max_body_bytes} at most"
            raise LineError(number, message)
        if line.custom_id in seen:
            raise LineError(
                number, f"custom_id {line.custom_id!r} is also on line {seen[line.custom_id]}"
            )
        seen[line.custom_id] = number
        named = str(line.body["model"])
        if model is not None and named != model:
            raise LineError(number, f"model {named!r}: the lines before it ask for {model!r}")
        model = named
        lines.append(line)
        if len(lines) > MAX_LINES:
            raise LineError(number, f"more than {MAX_LINES} requests in one batch")
    if not lines:
        raise LineError(0, "the file holds no request")
    return lines


def _one(number: int, raw: str, endpoint: str, model_type: type[BaseModel]) -> BatchLine:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LineError(number, f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise LineError(number, "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 512:
        raise LineError(number, "custom_id must be a string of 1 to 512 characters")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(number, f"unknown field {unknown[0]!r}")
    if item.get("method", "POST") != "POST":
        raise LineError(number, f"method {item.get('method')!r}: only POST")
    if item.get("url") != endpoint:
        raise LineError(number, f"url {item.get('url')!r}: this batch's endpoint is {endpoint}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError(number, "body must be a JSON object (the request)")
    if body.get("stream"):
        raise LineError(number, "body.stream: a batch's answers are whole, not streamed")
    try:
        model_type.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise LineError(number, f"body.{where}: {first['msg']}") from None
    return BatchLine(number, custom_id, body)


@dataclass
class Progress:
    """One batch as the runner holds it: its requests, those answered, those still to send
    (in the file's order; one preempted or tried again goes back to the front), and the most
    units (tokens) one of them may make."""

    lines: list[BatchLine]
    answered: set[str]
    model: str = ""
    #: The edge deployment it runs on (``edgeflow``), or "" for the cloud (the model's name).
    lane: str = ""
    queue: deque[BatchLine] = field(default_factory=deque)
    most: int = 1

    def __post_init__(self) -> None:
        self.queue = deque(ln for ln in self.lines if ln.custom_id not in self.answered)
        self.most = max((max(ln.token_budget, 1) for ln in self.lines), default=1)

    @property
    def left(self) -> int:
        """Requests not answered yet."""
        return len(self.lines) - len(self.answered)

    def answer(self, line: BatchLine) -> None:
        self.answered.add(line.custom_id)

    @property
    def key(self) -> str:
        """What its throughput is measured under: the edge deployment, or the model."""
        return self.lane or self.model


def run_name(batch_id: str, custom_id: str) -> str:
    """The training run of a batch's line: its checkpoint's name, the same at each attempt."""
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:16]}"


def units_made(answer: dict[str, Any]) -> float:
    """What a request made: its completion tokens (Anthropic's output tokens; a training
    run's steps), or 1 for a request that makes none."""
    usage = answer.get("usage") or {}
    made = usage.get("completion_tokens") or usage.get("output_tokens") or usage.get("steps") or 0
    return float(max(int(made), 1))
