"""What every request passes: API keys, per-client rates, the body-size limit, and errors in
OpenAI's shape.

The body limit counts the bytes actually received, not what ``Content-Length`` claims: a
chunked upload (no length) past the limit gets 413 as soon as it passes it, and the rest of
it is never handed to the application."""

from __future__ import annotations

import logging
import math
import time

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.core.access_log import AccessLog
from services.gateway.core.errors import ApiError, error_response
from services.gateway.core.keyring import KeyRing
from services.gateway.core.rates import RateLimiter
from services.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

_KINDS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
_CODES = {413: "request_too_large"}


class BodyTooLarge(HTTPException):
    """Raised to whoever reads a request body past the limit. An ``HTTPException``: FastAPI
    passes it on from its body parsing as it is, and the handler below answers 413."""

    def __init__(self, received: int, limit: int) -> None:
        super().__init__(413, f"request body of {received} bytes or more exceeds {limit}")


class BodyLimit:
    """ASGI middleware: refuses a declared ``Content-Length`` over ``max_bytes``
    (``files_max_bytes`` for an upload to ``/v1/files``) before reading anything, and counts
    the body's bytes as they arrive, raising ``BodyTooLarge`` from
    ``receive`` at the first chunk past the limit (the application stops reading there)."""

    def __init__(self, app: ASGIApp, max_bytes: int, files_max_bytes: int) -> None:
        self.app, self.most, self.files_most = app, max_bytes, files_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # An uploaded file (the Batch API's) may be larger than a request.
        upload = scope["path"] == "/v1/files" and scope["method"] == "POST"
        most = self.files_most if upload else self.most
        length = Headers(scope=scope).get("content-length")
        if length is not None and not length.isdigit():
            await error_response(400, "invalid Content-Length")(scope, receive, send)
            return
        if length is not None and int(length) > most:
            message = f"request body of {length} bytes exceeds {most}"
            refused = error_response(413, message, code="request_too_large")
            await refused(scope, receive, send)
            return
        received, answered = 0, False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > most:
                    raise BodyTooLarge(received, most)
            return message

        async def sending(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyTooLarge as exc:  # read outside the exception handlers' reach
            if answered:
                raise
            refused = error_response(413, str(exc.detail), code="request_too_large")
            await refused(scope, receive, send)


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return error_response(400, message or "invalid request", param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = _KINDS.get(exc.status_code, "invalid_request_error")
        return error_response(
            exc.status_code,
            str(exc.detail),
            kind,
            _CODES.get(exc.status_code),
            headers=dict(exc.headers or {}),
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", extra={"path": request.url.path})
        return error_response(500, "internal error; see the gateway log", "server_error")


def presented_key(scope: Scope) -> str | None:
    """The API key a request carries: ``x-api-key`` (Anthropic's clients send it so), else a
    bearer token."""
    headers = Headers(scope=scope)
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if "x-api-key" in headers:
        scheme, token = "bearer", headers["x-api-key"]
    return token if scheme.lower() == "bearer" else None


#: The batch runner's key, and the only paths it is taken on (a batch worker holds it).
RUNNER = "batch-runner"
RUNNER_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"}
)


class Limits:
    """ASGI middleware: the API key and the client's rate, checked on the API's paths (OpenAI's,
    Anthropic's, Ollama's) before anything else runs. Plain ASGI, not ``@app.middleware``:
    that wraps every response in a task and a memory stream, a hop per streamed token."""

    def __init__(
        self, app: ASGIApp, settings: GatewaySettings, by_key: Counter, runner_key: str
    ) -> None:
        self.app, self.settings, self.by_key = app, settings, by_key
        self.keys = KeyRing(settings.api_keys, settings.keys_file, {RUNNER: runner_key})
        self.access = AccessLog(settings.access_log)
        self.rates = RateLimiter(settings.rate_per_s, settings.rate_burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(("/v1/", "/api/")):
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), [500]

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        name = self.key_name(scope)
        try:
            refused = self.refusal(scope, name)
            if refused is not None:
                await refused(scope, receive, sent)
            else:
                await self.app(scope, receive, sent)
        finally:
            address = scope.get("client")
            self.access.write(
                scope["method"], scope["path"], name, status[0], started,
                address[0] if address else "",
            )  # fmt: skip

    def key_name(self, scope: Scope) -> str | None:
        """The name of the key the request carries, when it is one of the gateway's."""
        token = presented_key(scope)
        return None if token is None else self.keys.name_of(token)

    def refusal(self, scope: Scope, name: str | None) -> Response | None:
        if self.keys.required and name is None:
            return error_response(
                401, "missing or invalid API key", "authentication_error", "invalid_api_key"
            )
        if name == RUNNER and scope["path"] not in RUNNER_PATHS:
            return error_response(
                403, "the batch runner's key serves requests only", "permission_error"
            )
        if name is not None:
            self.by_key.labels(name).inc()  # the key's name, never the key
        address = scope.get("client")
        client = name if name is not None else (address[0] if address else "")
        wait = self.rates.take(client)
        if wait > 0:
            settings = self.settings
            return error_response(
                429,
                f"more than {settings.rate_burst} requests at once or "
                f"{settings.rate_per_s:g} per second; retry in {wait:.2f} s",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )
        return None


def install_limits(
    app: FastAPI, settings: GatewaySettings, registry: CollectorRegistry, runner_key: str
) -> None:
    """The limits, and the key of the gateway's own batch runner (``runner_key``, made at its
    start and never written anywhere)."""
    by_key = Counter(
        "tessera_gateway_key_requests",
        "API requests accepted, by the name of the key that made them",
        ["key"],
        registry=registry,
    )
    # Added first, so it runs inside the key and rate checks (they answer first).
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, files_max_bytes=settings.files_max_bytes
    )
    app.add_middleware(Limits, settings=settings, by_key=by_key, runner_key=runner_key)
