"""The scheduler's HTTP API: previews, deployments, mode and policy, health and metrics.

The gateway's admin API proxies these under /v1/cluster/…; this is where they live.
Handlers that change state queue a command on the scheduler's loop and wait for its answer;
``POST /placements`` answers with the plan (the deployment is then pending: follow it with
``GET /placements/{id}`` until serving, refused or failed).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from libs.contracts import (
    DeploymentsSnapshot,
    DeploymentStatus,
    Mode,
    ModelDeployment,
    PlacementDecision,
    PlacementRequest,
    Speed,
)
from libs.contracts.admin import DeployBody, ModeBody, PolicyBody, PreviewBody
from libs.contracts.base import Precision
from libs.contracts.models import ModelCard
from libs.core.partition import Preview
from libs.core.policies import POLICIES
from libs.deployments import phases
from services.scheduler.models_api import model_routes
from services.scheduler.service import Scheduler


def create_api(scheduler: Scheduler) -> FastAPI:
    app = FastAPI(title="Tessera scheduler", version="0.1.0")
    model_routes(app, scheduler)

    async def _known_model(model: str) -> None:
        """404 unless ``model`` is registered (its card is then the scheduler's)."""
        await scheduler.learn(model)
        if model not in scheduler.planner.cards:
            known = ", ".join(sorted(await scheduler.registry.names())) or "none"
            raise HTTPException(
                404,
                f"unknown model {model!r}; registered: {known} "
                "(add it with `tessera models add FILE.gguf`)",
            )

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "mode": scheduler.modes.mode.value,
            "deployments": len(scheduler.book),
            "devices": sorted(scheduler.view.rows.keys() - scheduler.view.failed),  # live
        }

    def shown(
        model: str,
        context_length: int | None,
        max_shards: int,
        precision: str | None,
        card: ModelCard | None = None,
    ) -> list[dict[str, Any]]:
        now = scheduler.clock()
        book, planner = scheduler.book, scheduler.planner
        context = planner.context_for(book, model, context_length, now, card)
        options = planner.preview(
            book, model, context, max_shards, now, precision=precision, card=card
        )
        devices = {d.device_id: d for d in planner.model_devices(book, now)}

        def speed(p: Preview) -> Speed | None:
            route = [(s.device_id, s.layers) for s in p.shards]
            return planner.predicted(p.model, route, devices, precision, card)

        return [
            {
                "devices": list(p.devices),
                "feasible": p.feasible,
                "reason": p.reason,
                "step_ms": p.step_ms,
                "predicted": None if guess is None else guess.model_dump(),
                "shards": [
                    {
                        "device_id": s.device_id,
                        "shard_index": s.shard_index,
                        "layer_start": s.layer_start,
                        "layer_end": s.layer_end,
                        "memory_gb": s.memory_gb,
                        "vram_gb": s.vram_gb,
                        "gpu_layers": s.gpu_layers,
                    }
                    for s in p.shards
                ],
            }
            for p in options
            for guess in [speed(p)]
        ]

    @app.get("/instance/previews")
    async def instance_previews(
        model: str,
        context_length: Annotated[int | None, Query(ge=1, le=1_048_576)] = None,
        max_shards: Annotated[int, Query(ge=1, le=256)] = 8,
        precision: Precision | None = None,
    ) -> list[dict[str, Any]]:
        """Every candidate placement: per-device layers and memory (in ``precision``), or why
        it is infeasible."""
        await _known_model(model)
        return shown(model, context_length, max_shards, precision)

    @app.post("/instance/previews")
    async def card_previews(body: PreviewBody) -> list[dict[str, Any]]:
        """The same for a model not registered, by its card (registers nothing). A card the
        caller wrote is not trusted: sizes that cannot be planned are a 400 naming why."""
        card = body.card
        try:
            return shown(card.name, body.context_length, body.max_shards, body.precision, card)
        except (ValueError, ArithmeticError) as exc:
            raise HTTPException(400, f"the card's sizes cannot be planned: {exc}") from None

    @app.post("/placements", status_code=201)
    async def deploy(body: DeployBody) -> PlacementDecision:
        await _known_model(body.model)
        task = ModelDeployment(
            deployment_id=body.deployment_id or f"dep-{uuid.uuid4().hex[:12]}",
            model=body.model,
            context_length=body.context_length,
            max_shards=body.max_shards,
            replicas=body.replicas,
            precision=body.precision,
            shard_count=body.shards,
            devices=body.devices,
        )
        decision = await scheduler.submit(PlacementRequest(task=task, ts=scheduler.clock()))
        if not decision.placed:
            raise HTTPException(409, decision.reason or "infeasible")
        return decision

    @app.get("/placements")
    async def placements() -> list[dict[str, Any]]:
        """Every deployment: its plan, ``phase``, ``progress`` and ``reason``."""
        return [
            d.model_dump(mode="json") | {"progress": phases.progress(d)} for d in scheduler.book
        ]

    @app.get("/deployments")
    async def deployments() -> DeploymentsSnapshot:
        """The deployment book as one snapshot (a follower's start, or its catch-up)."""
        return scheduler.book.snapshot(scheduler.clock())

    @app.get("/placements/{deployment_id}")
    async def placement(deployment_id: str) -> DeploymentStatus:
        """Where one deployment stands: its phase and the progress of its plan."""
        found = scheduler.book.get(deployment_id)
        if found is None:
            raise HTTPException(404, f"no deployment {deployment_id!r}")
        return phases.status_of(found, scheduler.clock())

    @app.delete("/placements/{deployment_id}", status_code=204)
    async def undeploy(deployment_id: str) -> Response:
        if not await scheduler.undeploy(deployment_id):
            raise HTTPException(404, f"no deployment {deployment_id!r}")
        return Response(status_code=204)

    @app.get("/mode")
    async def get_mode() -> dict[str, Any]:
        return {"mode": scheduler.modes.mode.value, "manual": scheduler.modes.manual}

    @app.put("/mode")
    async def put_mode(body: ModeBody) -> dict[str, Any]:
        mode = None if body.mode == "auto" else Mode(body.mode)
        reason = "manual override" if mode else "automatic"
        await scheduler.loop.call(
            lambda: scheduler.modes.set_mode(mode, reason, manual=True), "mode"
        )
        return await get_mode()

    @app.get("/policy")
    async def get_policy() -> dict[str, Any]:
        return {
            "policy": scheduler.modes.policy_name,
            "profile": scheduler.modes.profile.model_dump(mode="json"),
            "available": sorted(POLICIES),
        }

    @app.put("/policy")
    async def put_policy(body: PolicyBody) -> dict[str, Any]:
        if body.policy not in POLICIES:
            raise HTTPException(422, f"unknown policy {body.policy!r}; known: {sorted(POLICIES)}")
        try:
            await scheduler.loop.call(
                lambda: scheduler.modes.set_policy(body.policy, body.profile), "policy"
            )
        except KeyError as exc:
            raise HTTPException(422, str(exc.args[0])) from None
        return await get_policy()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(scheduler.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
