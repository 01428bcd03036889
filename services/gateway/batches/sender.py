"""How the batch runner sends a request: through the gateway's own application."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from services.gateway.core.answers import DEVICES_HEADER

#: Sends one request body to an endpoint of the gateway; its status, JSON answer and the
#: devices that answered it.
Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any], list[str]]]]


class AsgiSender:
    """Sends each request through the gateway's own application in this process (its keys,
    limits, metrics and traces), with the runner's key."""

    def __init__(self, app: Any, key: str) -> None:
        transport = httpx.ASGITransport(app=app)
        self.client = httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=None
        )
        self.headers = {"authorization": f"Bearer {key}"}

    async def __call__(
        self, endpoint: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], list[str]]:
        answer = await self.client.post(endpoint, json=body, headers=self.headers)
        try:
            parsed = answer.json()
        except ValueError:
            parsed = {"error": {"message": answer.text[:500]}}
        devices = [d for d in answer.headers.get(DEVICES_HEADER, "").split(",") if d]
        return answer.status_code, parsed if isinstance(parsed, dict) else {"data": parsed}, devices

    async def aclose(self) -> None:
        await self.client.aclose()
