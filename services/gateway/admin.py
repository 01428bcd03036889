"""The admin API, ``/v1/cluster/…``: the scheduler's API, proxied (one documented place).

Placements and previews, mode and policy live in the scheduler (services/scheduler/api.py),
which validates every body; the gateway forwards the request and passes the answer through,
wrapping errors in OpenAI's shape. Devices and scores are read from Redis.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import APIRouter, Request, Response

from libs.cli.devices import fetch
from libs.contracts.keys import Keys
from services.gateway.openai_api import ApiError
from services.gateway.settings import GatewaySettings


def admin_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1/cluster", tags=["admin"])

    @router.get("/devices", summary="Devices with their five scores, best first")
    async def devices(request: Request, limit: int = 100) -> list[dict[str, Any]]:
        rows = await fetch(request.app.state.redis, Keys(), max(1, min(limit, 10_000)))
        return [{"device_id": d, **row} for d, row in rows]

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                answer = await http.request(
                    request.method,
                    f"{settings.scheduler_url}/{path}",
                    params=request.query_params,
                    content=body,
                    headers={"content-type": "application/json"} if body else {},
                )
        except httpx.HTTPError as exc:
            raise ApiError(503, f"scheduler unreachable: {exc}", "server_error") from None
        if answer.status_code >= 400:
            try:
                detail = answer.json().get("detail", answer.text)
            except ValueError:
                detail = answer.text
            message = detail if isinstance(detail, str) else json.dumps(detail)[:2000]
            raise ApiError(answer.status_code, message)
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    @router.api_route(
        "/placements", methods=["GET", "POST"], summary="Deployments; POST deploys a model"
    )
    async def placements(request: Request) -> Response:
        return await forward(request, "placements")

    @router.delete("/placements/{deployment_id}", status_code=204, summary="Undeploy")
    async def undeploy(deployment_id: str, request: Request) -> Response:
        return await forward(request, f"placements/{deployment_id}")

    @router.get("/previews", summary="Partition previews for a model")
    async def previews(request: Request) -> Response:
        return await forward(request, "instance/previews")

    @router.api_route("/mode", methods=["GET", "PUT"], summary="Scheduling mode (PUT: or auto)")
    async def mode(request: Request) -> Response:
        return await forward(request, "mode")

    @router.api_route("/policy", methods=["GET", "PUT"], summary="Scheduling policy")
    async def policy(request: Request) -> Response:
        return await forward(request, "policy")

    return router
