"""Ollama's model endpoints: ``/api/tags`` (what serves), ``/api/show`` (one model's card),
``/api/ps`` (what is loaded: the serving deployments) and ``/api/pull`` (a model that serves
is here already; none is fetched from a registry), filled from the model registry's
card of each model (its GGUF's architecture, sizes, tensor types, context and template).

A model the registry has no card of (a removal in flight) is listed with empty details.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from libs.contracts import DEFAULT_CONTEXT_TOKENS
from libs.contracts.models import ModelCard
from libs.models.registry import ModelRegistry
from services.gateway.error_shapes import OllamaError, documented_as
from services.gateway.openai_api import ApiError

ERRORS = documented_as(OllamaError, 400, 401, 404, 413, 429, 503)
#: A deployment is not unloaded for being idle (Ollama's ``keep_alive`` -1 reads the same).
NEVER = "2318-01-01T00:00:00Z"


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    insecure: bool | None = None
    stream: bool = True


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    verbose: bool | None = None


def model_name(name: str) -> str:
    """Ollama's clients name ``model:latest``; the deployment is ``model``."""
    return name.removesuffix(":latest") or name


def stamp(ts: float | None = None) -> str:
    when = datetime.fromtimestamp(ts, UTC) if ts is not None else datetime.now(UTC)
    return when.isoformat().replace("+00:00", "Z")


def parameter_size(params: int) -> str:
    """Ollama's way of writing a parameter count: "134.52M", "7.6B"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= size:
            return f"{params / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(params)


def quantization(card: ModelCard) -> str:
    """The file's quantization as Ollama names it: the tensor type its file name names
    ("…-Q8_0.gguf"), else the first type that is not F32 (norms stay F32 in every file)."""
    named = [t for t in card.tensor_types if t.lower() in card.file_name.lower()]
    others = [t for t in card.tensor_types if t != "F32"]
    return (named or others or list(card.tensor_types) or [""])[0]


def details(card: ModelCard | None) -> dict[str, Any]:
    if card is None:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }
    return {
        "parent_model": "",
        "format": "gguf",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": parameter_size(card.params),
        "quantization_level": quantization(card),
    }


def entry(name: str, card: ModelCard | None) -> dict[str, Any]:
    """A model as ``/api/tags`` lists it."""
    return {
        "name": name,
        "model": name,
        "modified_at": stamp(card.added_ts if card else None),
        "size": card.size_bytes if card else 0,
        "digest": card.sha256 if card else "",
        "details": details(card),
    }


def model_info(card: ModelCard | None, context: int) -> dict[str, Any]:
    """Ollama's ``model_info``: GGUF's own keys, as Ollama shows them."""
    if card is None:
        return {"general.architecture": "", "context_length": context}
    arch = card.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.parameter_count": card.params,
        f"{arch}.context_length": card.context_train,
        f"{arch}.block_count": card.layers,
    }
    if card.tokenizer_model:
        info["tokenizer.ggml.model"] = card.tokenizer_model
    return info


def parameters(card: ModelCard | None, context: int) -> str:
    """Ollama's ``parameters`` text: the deployment's context and the model's stop tokens."""
    lines = [f"num_ctx {context}"]
    lines += [f'stop "{token}"' for token in (card.stop_tokens if card else ())]
    return "\n".join(lines)


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
        deployment = await deployments.lookup(model_name(body.model))
        context = deployments.context.get(deployment, DEFAULT_CONTEXT_TOKENS)
        card = await card_of(request, deployments.models.get(deployment, deployment))
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
            serving = [
                d
                for d, m in deployments.models.items()
                if m == name and deployments.phase(d) == "serving"
            ]
            context = max((deployments.context.get(d, 0) for d in serving), default=0)
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
