"""The scheduler's model routes: the registry (``/models``) through the HTTP API.

The scheduler writes the registry (its Redis user may; the gateway's reads only) and knows
which engines the cluster runs and which deployments use a model, so adding and removing
happen here; each card says which of the cluster's engines serve the model and why each
other does not (``engines``). The gateway's ``/v1/cluster/models`` forwards to these routes.
Removing a model also removes its weights from the cluster's object store, unless another
registered name is the same file (its NATS user may mark an object deleted and purge its
chunks, never write one: ``libs/cluster/access.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException

from libs.contracts import ModelCard
from libs.contracts.admin import AddModelBody
from libs.models.engine_support import unserved_reason
from libs.models.gguf_info import ModelFileError, read_card
from libs.models.registry import ModelError, NameTaken
from libs.weights.local_files import mark_verified
from services.scheduler.service import Scheduler


def is_remote(source: str) -> bool:
    return source.startswith(("hf:", "http://", "https://"))


def fetch_remote(source: str) -> str:
    """A URL's or ``hf:`` source's file, downloaded to this host (``libs/models/hub.py``:
    resumable, checksummed; a host with no route is told at once)."""
    from libs.models.hub import DownloadError, download

    try:
        return str(download(source))
    except DownloadError as exc:
        raise HTTPException(400, f"could not download {source}: {exc}") from None


def model_routes(app: FastAPI, scheduler: Scheduler) -> None:
    def engines() -> set[str]:
        return {e for a in scheduler.view.announces.values() for e in a.engines}

    def users(name: str) -> list[str]:
        return [d.deployment_id for d in scheduler.book.live() if d.model == name]

    def served(card: ModelCard) -> list[dict[str, Any]]:
        """Which engines of the cluster can serve the model, and why each other cannot."""
        why = {e: unserved_reason(e, card) for e in sorted(engines())}
        return [{"engine": e, "serves": r is None, "why_not": r} for e, r in why.items()]

    @app.get("/models")
    async def list_models() -> list[dict[str, Any]]:
        """Every registered model's card, with the live deployments of it."""
        return [
            c.model_dump(mode="json", exclude={"chat_template"})
            | {"deployments": users(c.name), "engines": served(c)}
            for c in await scheduler.registry.list()
        ]

    @app.get("/models/{name}")
    async def show_model(name: str) -> dict[str, Any]:
        card = await scheduler.registry.get(name)
        if card is None:
            raise HTTPException(404, f"no model {name!r}")
        return card.model_dump(mode="json") | {"deployments": users(name), "engines": served(card)}

    @app.post("/models", status_code=201)
    async def add_model(body: AddModelBody) -> ModelCard:
        """Register a model from a file on this host (``source``) or a card read elsewhere."""
        if (body.card is None) == (body.source is None):
            raise HTTPException(422, "give either source (a path here) or card")
        card = body.card
        if card is None:
            assert body.source is not None
            source = body.source
            path = await asyncio.to_thread(fetch_remote, source) if is_remote(source) else source
            try:
                card = await asyncio.to_thread(
                    read_card,
                    path,
                    name=body.name,
                    source=source if is_remote(source) else None,
                    expect_sha256=body.sha256,
                )
            except ModelFileError as exc:
                raise HTTPException(400, str(exc)) from None
            # Known to be the model's: a worker of this host lends it (libs/weights/lending.py).
            with contextlib.suppress(OSError):
                await asyncio.to_thread(mark_verified, Path(path), card.sha256)
        else:
            if body.sha256 and body.sha256.lower() != card.sha256:
                raise HTTPException(400, f"corrupt: {card.name}'s sha256 is not {body.sha256}")
            if body.name:
                card = card.model_copy(update={"name": body.name})
        known = engines()
        try:
            added = await scheduler.registry.add(card, known if known else None)
        except NameTaken as exc:
            raise HTTPException(409, str(exc)) from None
        except ModelError as exc:
            raise HTTPException(400, str(exc)) from None
        scheduler.planner.cards[added.name] = added
        return added

    @app.delete("/models/{name}")
    async def remove_model(name: str) -> dict[str, Any]:
        """Forget a model, refused while a deployment of it is live (undeploy it first), and
        remove its weights from the object store unless another registered name is the same
        file. ``weights``: ``removed``, ``kept`` (``same_file`` names the others) or
        ``absent`` (the store held none)."""
        live = users(name)
        if live:
            raise HTTPException(409, f"{name} is deployed ({', '.join(live)}): undeploy first")
        card = await scheduler.registry.get(name)
        if card is None or not await scheduler.registry.remove(name):
            raise HTTPException(404, f"no model {name!r}")
        scheduler.planner.cards.pop(name, None)
        same = sorted(c.name for c in await scheduler.registry.list() if c.sha256 == card.sha256)
        weights = "kept" if same else await drop_weights(card.sha256)
        return {"name": name, "weights": weights, "same_file": same}

    async def drop_weights(sha256: str) -> str:
        from libs.weights.whole_files import unpublish

        nc = getattr(scheduler.bus, "nc", None)  # NatsBus: its connection (as the worker's)
        if nc is None:  # a bus with no NATS (in-memory): no object store either
            return "absent"
        try:
            return "removed" if await unpublish(nc, sha256) else "absent"
        except Exception as exc:  # the card is gone; say what stays behind, do not hide it
            raise HTTPException(
                502, f"the model was removed but its weights could not be: {exc!r}"
            ) from None
