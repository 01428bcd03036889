"""What every request passes: API keys, per-client rates, the body-size limit, and errors in
OpenAI's shape."""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from services.gateway.openai_api import ApiError, error_response
from services.gateway.rates import RateLimiter
from services.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

_KINDS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


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
            exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", extra={"path": request.url.path})
        return error_response(500, "internal error; see the gateway log", "server_error")


def install_limits(app: FastAPI, settings: GatewaySettings) -> None:
    keys = [k.encode() for k in settings.api_keys]
    rates = RateLimiter(settings.rate_per_s, settings.rate_burst)

    @app.middleware("http")
    async def limits(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        if path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if keys and (
                scheme.lower() != "bearer"
                or not any(secrets.compare_digest(token.encode(), k) for k in keys)
            ):
                return error_response(
                    401, "missing or invalid API key", "authentication_error", "invalid_api_key"
                )
            client = token if keys else (request.client.host if request.client else "")
            wait = rates.take(client)
            if wait > 0:
                return error_response(
                    429,
                    f"more than {settings.rate_burst} requests at once or "
                    f"{settings.rate_per_s:g} per second; retry in {wait:.2f} s",
                    "rate_limit_error",
                    "rate_limit_exceeded",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "invalid Content-Length")
            if int(length) > settings.max_body_bytes:
                return error_response(
                    413,
                    f"request body of {length} bytes exceeds {settings.max_body_bytes}",
                    code="request_too_large",
                )
        return await call_next(request)
