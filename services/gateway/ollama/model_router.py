"""Ollama's model endpoints: ``/api/tags`` (what serves), ``/api/show`` (one model's card),
``/api/ps`` (what is loaded: the serving deployments) and ``/api/pull`` (a model that serves
is here already; none is fetched from a registry), filled from the model registry's
card of each model (its GGUF's architecture, sizes, tensor types, context and template).

A model the registry has no card of (a removal in flight) is listed with empty details.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response

from libs.contracts.models import ModelCard
from libs.models.registry import ModelRegistry
from services.gateway.core.error_shapes import OllamaError, documented_as
from services.gateway.core.errors import ApiError
from services.gateway.ollama.cards import NEVER, details, entry, model_info, parameters, stamp
from services.gateway.ollama.protocol import PullBody, ShowBody, model_name

ERRORS = documented_as(OllamaError, 400, 401, 404, 413, 429, 503)


async def card_of(request: Request, name: str) -> ModelCard | None:
    registry = ModelRegistry(request.app.state.redis, request.app.state.key_prefix)
    return await registry.get(name)


def ollama_models_router() -> APIRouter:
    router = APIRouter(prefix="/api", tags=["ollama"])

    @router.get("/tags", responses=ERRORS)
    async def tags(request: Request) -> dict[str, Any]:
        listed = request.app.state.deployments.listed
        return {"models": [entry(name, await card_of(request, name)) for name in listed]}

    @router.post("/show", responses=ERRORS)
    async def show(body: ShowBody, request: Request) -> dict[str, Any]:
        deployments = request.app.state.deployments
        resolved = await deployments.lookup(model_name(body.model))
        context = resolved.context_length
        card = await card_of(request, resolved.model)
        return {
            "modelfile": "",
            "parameters": parameters(card, context),
            "template": (card.chat_template if card else None) or "",
            "details": details(card),
            "model_info": model_info(card, context),
            "capabilities": ["completion", "tools", "embedding"],
            "modified_at": stamp(card.added_ts if card else None),
        }

    @router.post("/pull", responses=ERRORS)
    async def pull(body: PullBody, request: Request) -> Response:
        """Ollama's pull: a model this cluster serves is here already ("success"); no other is
        fetched from a registry: a 404 says how a model is added to the cluster."""
        name = model_name(body.model)
        try:
            await request.app.state.deployments.lookup(name)
        except ApiError as exc:
            raise ApiError(
                404,
                f"{exc.message}; Tessera pulls from no registry: add the model's GGUF with "
                "`tessera models add FILE.gguf|URL|hf:ORG/REPO` and `tessera deploy NAME`",
                param="model",
            ) from None
        done = json.dumps({"status": "success"})
        if body.stream:
            return Response(done + "\n", media_type="application/x-ndjson")
        return Response(done, media_type="application/json")

    @router.get("/ps", responses=ERRORS)
    async def ps(request: Request) -> dict[str, Any]:
        """The serving deployments, one per model: its size, and its deployment's context."""
        deployments = request.app.state.deployments
        loaded = []
        for name in deployments.listed:
            serving = [d for d in deployments.book if d.model == name and d.phase == "serving"]
            context = max((d.context_length for d in serving), default=0)
            card = await card_of(request, name)
            size = card.size_bytes if card else 0
            loaded.append(
                {
                    **entry(name, card),
                    "expires_at": NEVER,
                    "size_vram": size,  # held in the serving devices' memory
                    "context_length": context,
                }
            )
        return {"models": loaded}

    return router
