"""The scheduler's HTTP API, wherever the leading replica is.

Only the leader serves HTTP (a follower has nothing to tell), so the gateway asks each replica
in turn (``TESSERA_GATEWAY_SCHEDULER_URL``: one URL, or several separated by commas) and takes
the first answer.
"""

from __future__ import annotations

from typing import Any

import httpx

#: Made once: building the default SSL context took a quarter of the gateway's CPU under load,
#: as every call opened a client of its own.
SSL_CONTEXT = httpx.create_ssl_context()


def split_urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


async def ask_scheduler(
    urls: list[str], method: str, path: str, timeout_s: float = 10.0, **kw: Any
) -> httpx.Response:
    """The first replica's answer; raises the last ``httpx.TransportError`` if none answers."""
    error: httpx.TransportError = httpx.ConnectError("no scheduler URL configured")
    async with httpx.AsyncClient(timeout=timeout_s, verify=SSL_CONTEXT) as http:
        for url in urls:
            try:
                return await http.request(method, f"{url}/{path.lstrip('/')}", **kw)
            except httpx.TransportError as exc:
                error = exc
    raise error
