"""The operator's dashboard: one page served by the gateway at ``/``, its assets beside it in
``dashboard/`` (no CDN: it works on a LAN with no internet). The page reads the admin API with
the user's API key (a login form asks for it when auth is on) and follows
``/v1/cluster/events``; the page and its assets hold no data and need no key."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

ASSETS = Path(__file__).with_name("dashboard")
TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}


def dashboard_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def page() -> FileResponse:
        return FileResponse(ASSETS / "index.html", media_type=TYPES[".html"])

    @router.get("/dashboard/{name}")
    async def asset(name: str) -> FileResponse:
        path = ASSETS / name
        if path.suffix not in TYPES or not path.is_file() or path.parent != ASSETS:
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(path, media_type=TYPES[path.suffix])

    return router
