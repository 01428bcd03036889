"""Each API's error body: OpenAI's, Anthropic's (``/v1/messages``) or Ollama's (``/api/``).

The gateway raises its errors once (``ApiError``, validation, limits) and answers each in the
shape the client of that path parses."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.core.errors import documented

#: Anthropic's error types by status.
ANTHROPIC = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class OllamaError(BaseModel):
    error: str


def documented_as(body: type[BaseModel], *codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these statuses with another API's error body."""
    return {c: {**meaning, "model": body} for c, meaning in documented(*codes).items()}


def shaped(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (OpenAI's ``{"error": {...}}``) as the API of ``path`` answers errors."""
    message = str(body.get("error", {}).get("message", ""))
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        kind = ANTHROPIC.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if path.startswith("/api/"):
        return {"error": message}
    return body


class ErrorShapes:
    """ASGI middleware: an error answer (status 400 or more, JSON) on an Anthropic or Ollama
    path is rewritten into that API's shape, whichever part of the gateway answered it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/v1/messages" or path.startswith(("/v1/messages/", "/api/"))):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = bytearray()

        async def sending(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = Headers(raw=message.get("headers", []))
                if message["status"] >= 400 and "json" in headers.get("content-type", ""):
                    start = message
                    return
            elif start is not None and message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _send_shaped(send, start, bytes(body), path)
                return
            await send(message)

        await self.app(scope, receive, sending)


async def _send_shaped(send: Send, start: Message, body: bytes, path: str) -> None:
    try:
        new = json.dumps(shaped(path, start["status"], json.loads(body))).encode()
    except (ValueError, AttributeError):
        new = body
    headers = MutableHeaders(raw=list(start.get("headers", [])))
    headers["content-length"] = str(len(new))
    await send({**start, "headers": headers.raw})
    await send({"type": "http.response.body", "body": new})
