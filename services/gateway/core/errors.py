"""The gateway's one error: ``ApiError``, answered in OpenAI's shape (``error_shapes`` rewrites
it for Anthropic's and Ollama's paths), and the OpenAPI description of each error status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param, self.headers = code, param, headers

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.kind, self.code, self.param, self.headers
        )


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


_MEANINGS = {
    400: "Bad request: invalid JSON, a field out of range, or the context length exceeded",
    401: "Missing or invalid API key",
    404: "Not found: the model is not deployed, or no such deployment",
    409: "Conflict: the model cannot be placed on the devices there are",
    413: "Request body too large",
    429: "Too many requests (in flight, or from this client per second); retry after "
    "Retry-After seconds",
    503: "No capacity: the generation could not run, or a service is unreachable",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with OpenAI's error body."""
    return {c: {"description": _MEANINGS[c], "model": ErrorBody} for c in codes}
