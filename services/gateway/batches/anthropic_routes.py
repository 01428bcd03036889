"""Anthropic's Message Batches on the same core as OpenAI's Batch API: the requests come inline
(``{"requests": [{"custom_id", "params"}]}``), are kept as a batch input file of
``/v1/messages`` requests, admitted by the same deadline rule (Anthropic's window: 24 hours)
and run by the same runner; their results are read back in Anthropic's shape
(``succeeded``, ``errored``, ``canceled``, ``expired``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.batches.routes import BatchCreate, create, runner_of
from services.gateway.batches.store import FINAL, JobStore
from services.gateway.core.error_shapes import AnthropicError, documented_as
from services.gateway.core.errors import ApiError
from services.gateway.settings import GatewaySettings

ENDPOINT = "/v1/messages"
WINDOW = "24h"


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    params: dict[str, Any]


class MessageBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: Annotated[list[BatchRequest], Field(min_length=1, max_length=100_000)]


def message_batches_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1/messages/batches", tags=["anthropic"])
    errors = documented_as(AnthropicError, 400, 401, 404, 413, 503)

    @router.post("", responses=errors)
    async def create_batch(request: Request, body: MessageBatchCreate) -> dict[str, Any]:
        runner = runner_of(request)
        lines = [
            {"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.params}
            for r in body.requests
        ]
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        file = await runner.store.add_file(content, "message_batch.jsonl", "batch")
        asked = BatchCreate(input_file_id=file["id"], endpoint=ENDPOINT, completion_window=WINDOW)
        try:
            batch = await create(request, asked, settings, where=lambda n: f"requests.{n - 1}")
        except ApiError:
            await runner.store.delete_file(file["id"])  # nothing of a refused batch is kept
            raise
        return await shaped(runner.store, batch["id"])

    @router.get("", responses=errors)
    async def list_batches(
        request: Request,
        after_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    ) -> dict[str, Any]:
        store = runner_of(request).store
        ids = [i for i in await store.batch_ids(10**6, after_id) if await _ours(store, i)]
        data = [await shaped(store, i) for i in ids[:limit]]
        return {
            "data": data,
            "has_more": len(ids) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @router.get("/{batch_id}", responses=errors)
    async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
        return await shaped(runner_of(request).store, batch_id)

    @router.post("/{batch_id}/cancel", responses=errors)
    async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
        runner = runner_of(request)
        await shaped(runner.store, batch_id)  # 404 for none
        await runner.store.cancel(batch_id)
        runner.wake.set()
        return await shaped(runner.store, batch_id)

    @router.get("/{batch_id}/results", responses=errors)
    async def results(request: Request, batch_id: str) -> Response:
        store = runner_of(request).store
        batch = await shaped(store, batch_id)
        if batch["processing_status"] != "ended":
            raise ApiError(400, f"batch {batch_id} is still {batch['processing_status']}")
        rows = [_result(line) for line in await _outputs(store, batch_id)]
        content = "".join(json.dumps(r) + "\n" for r in rows)
        return Response(content, media_type="application/x-jsonl")

    return router


async def _ours(store: JobStore, batch_id: str) -> bool:
    raw = await store.raw(batch_id)
    return raw is not None and raw["endpoint"] == ENDPOINT


async def _outputs(store: JobStore, batch_id: str) -> list[dict[str, Any]]:
    """Every request's output line, answered or not, in the input's order."""
    raw = await store.raw(batch_id) or {}
    lines = (await store.content(raw.get("input_file_id", "")) or b"").decode().splitlines()
    kept = {**await store.answers(batch_id, True), **await store.answers(batch_id, False)}
    ids = [json.loads(x)["custom_id"] for x in lines if x.strip()]
    return [json.loads(kept[i]) for i in ids if i in kept]


def _result(line: dict[str, Any]) -> dict[str, Any]:
    """One output line of the core as Anthropic's result line."""
    response, error = line.get("response"), line.get("error")
    if response is not None and response["status_code"] == 200:
        result: dict[str, Any] = {"type": "succeeded", "message": response["body"]}
    elif error is not None and error.get("code") == "batch_cancelled":
        result = {"type": "canceled"}
    elif error is not None and error.get("code") == "batch_expired":
        result = {"type": "expired"}
    else:
        result = {"type": "errored", "error": (response or {}).get("body", error)}
    return {"custom_id": line["custom_id"], "result": result}


async def shaped(store: JobStore, batch_id: str) -> dict[str, Any]:
    """The batch as Anthropic's ``MessageBatch``."""
    raw = await store.raw(batch_id)
    if raw is None or raw["endpoint"] != ENDPOINT:
        raise ApiError(404, f"no message batch {batch_id!r}", code="not_found_error")
    counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    for line in await _outputs(store, batch_id):
        counts[_result(line)["result"]["type"]] += 1
    counts["processing"] = raw["total"] - sum(counts.values())
    status = raw["status"]
    ended = status in FINAL
    return {
        "id": batch_id,
        "type": "message_batch",
        "processing_status": "ended"
        if ended
        else "canceling"
        if status == "cancelling"
        else "in_progress",
        "request_counts": counts,
        "created_at": _iso(raw["created_at"]),
        "expires_at": _iso(raw["expires_at"]),
        "ended_at": _iso(raw.get(f"{status}_at")) if ended else None,
        "cancel_initiated_at": _iso(raw.get("cancelling_at")),
        "archived_at": None,
        "results_url": f"{ENDPOINT}/batches/{batch_id}/results" if ended else None,
    }


def _iso(ts: int | None) -> str | None:
    return (
        None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")
    )
