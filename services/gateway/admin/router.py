"""The admin API, ``/v1/cluster/…``: the scheduler's API, proxied (one documented place).

Placements and previews, models, mode and policy live in the scheduler (services/scheduler/api.py),
which validates every body; the gateway forwards the request and passes the answer through,
wrapping errors in OpenAI's shape. Devices and scores are read from Redis.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from libs.contracts import (
    DEFAULT_CONTEXT_TOKENS,
    DeploymentsSnapshot,
    DeploymentStatus,
    PlacementDecision,
)
from libs.contracts.admin import AddModelBody, DeployBody, ModeBody, PolicyBody, PreviewBody
from libs.contracts.base import TOKEN_PATTERN, Precision
from libs.contracts.keys import Keys
from libs.contracts.models import MODEL_NAME_PATTERN, ModelCard
from libs.runtime.redis_client import read_fleet
from services.gateway.core.errors import ApiError, documented
from services.gateway.core.schedulers import ask_scheduler, split_urls
from services.gateway.settings import GatewaySettings

ERRORS = documented(400, 401, 413, 429, 503)


def admin_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1/cluster", tags=["admin"], responses=ERRORS)
    keys = Keys(settings.key_prefix)

    @router.get("/devices", summary="Devices with their five scores, best first")
    async def devices(
        request: Request, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> list[dict[str, Any]]:
        fleet = await read_fleet(request.app.state.redis, keys, limit)
        return [
            {
                **row.model_dump(mode="json"),
                "capabilities": a.capabilities.model_dump(mode="json") if a else None,
                "sources": a.sources if a else {},
            }
            for row, a in fleet
        ]

    # An endless stream: kept out of the OpenAPI document (its fuzzing would wait forever);
    # docs/dashboard.md describes it.
    @router.get("/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        stream = await request.app.state.events.stream()
        return StreamingResponse(stream, media_type="text/event-stream")

    async def forward(request: Request, path: str, body: BaseModel | None = None) -> Response:
        content = body.model_dump_json(exclude_unset=True).encode() if body else None
        try:
            answer = await ask_scheduler(
                split_urls(settings.scheduler_url),
                request.method,
                path,
                params=request.query_params,
                content=content,
                headers={"content-type": "application/json"} if content else {},
            )
        except httpx.HTTPError as exc:
            raise ApiError(503, f"scheduler unreachable: {exc}", "server_error") from None
        if answer.status_code >= 400:
            try:
                detail = answer.json().get("detail", answer.text)
            except ValueError:
                detail = answer.text
            message = detail if isinstance(detail, str) else json.dumps(detail)[:2000]
            # The scheduler's own validation (422) is a bad request here, as on every route.
            raise ApiError(400 if answer.status_code == 422 else answer.status_code, message)
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    @router.get("/placements", summary="Deployments and where their shards run")
    async def placements(request: Request) -> Response:
        return await forward(request, "placements")

    @router.get(
        "/deployments",
        summary="The deployment book: every deployment, as the events up to its index left it",
        response_model=DeploymentsSnapshot,
    )
    async def deployments(request: Request) -> Response:
        return await forward(request, "deployments")

    @router.get(
        "/placements/{deployment_id}",
        summary="A deployment's phase (pending, loading, serving, refused, failed) and progress",
        response_model=DeploymentStatus,
        responses=documented(404),
    )
    async def placement(
        deployment_id: Annotated[str, Path(pattern=TOKEN_PATTERN)], request: Request
    ) -> Response:
        return await forward(request, f"placements/{deployment_id}")

    @router.post(
        "/placements",
        status_code=201,
        summary="Deploy a model",
        response_model=PlacementDecision,
        responses=documented(404, 409),
    )
    async def deploy(body: DeployBody, request: Request) -> Response:
        return await forward(request, "placements", body)

    @router.delete(
        "/placements/{deployment_id}",
        status_code=204,
        summary="Undeploy",
        responses=documented(404),
    )
    async def undeploy(
        deployment_id: Annotated[str, Path(pattern=TOKEN_PATTERN)], request: Request
    ) -> Response:
        return await forward(request, f"placements/{deployment_id}")

    @router.get("/previews", summary="Partition previews for a model", responses=documented(404))
    async def previews(
        request: Request,
        model: Annotated[str, Query(min_length=1, max_length=128)],
        context_length: Annotated[int, Query(ge=1, le=1_048_576)] = DEFAULT_CONTEXT_TOKENS,
        max_shards: Annotated[int, Query(ge=1, le=256)] = 8,
        precision: Precision | None = None,
    ) -> Response:
        return await forward(request, "instance/previews")

    @router.post(
        "/previews",
        summary="Partition previews for a model not registered, by its card",
        responses=documented(400),
    )
    async def card_previews(body: PreviewBody, request: Request) -> Response:
        return await forward(request, "instance/previews", body)

    @router.get("/models", summary="The registered models (cards without chat templates)")
    async def models(request: Request) -> Response:
        return await forward(request, "models")

    @router.get("/models/{name}", summary="A registered model's card", responses=documented(404))
    async def model(
        name: Annotated[str, Path(pattern=MODEL_NAME_PATTERN)], request: Request
    ) -> Response:
        return await forward(request, f"models/{name}")

    @router.post(
        "/models",
        status_code=201,
        summary="Register a model: a GGUF's path on the scheduler's host, or a card",
        response_model=ModelCard,
        responses=documented(404, 409),
    )
    async def add_model(body: AddModelBody, request: Request) -> Response:
        return await forward(request, "models", body)

    @router.delete(
        "/models/{name}",
        summary="Forget a model and remove its weights (refused while deployed)",
        responses=documented(404, 409),
    )
    async def remove_model(
        name: Annotated[str, Path(pattern=MODEL_NAME_PATTERN)], request: Request
    ) -> Response:
        return await forward(request, f"models/{name}")

    @router.get("/mode", summary="Scheduling mode and whether it was set by hand")
    async def mode(request: Request) -> Response:
        return await forward(request, "mode")

    @router.put("/mode", summary="Set the scheduling mode (or auto)")
    async def set_mode(body: ModeBody, request: Request) -> Response:
        return await forward(request, "mode", body)

    @router.get("/policy", summary="Scheduling policy, its profile, and the policies there are")
    async def policy(request: Request) -> Response:
        return await forward(request, "policy")

    @router.put("/policy", summary="Set the scheduling policy (and profile)")
    async def set_policy(body: PolicyBody, request: Request) -> Response:
        return await forward(request, "policy", body)

    return router
