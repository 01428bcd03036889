"""OpenAI's Files and Batches API: upload a JSONL file of requests, create a batch of it with a
completion window, poll it, read its output and error files, cancel it.

A batch is checked whole when it is created (``lines.py``): a fault is a 400 naming the line,
and nothing is queued. It is then admitted or declined at once by its deadline, under the
gateway's batch policy (``libs/core/batch_policies.py``: ``edf``, ``fifo``, ``elasticflow`` or
``edgeflow``, at the throughput measured for its model; ``edgeflow`` tries the model's edge
copies for what the cloud declines): declined, it is a 400 with the reason and no batch
exists. ``completion_window`` takes OpenAI's ``24h``
and any other span (``30m``, ``2h``): that is the batch's deadline. Beyond OpenAI, a batch of
the endpoint ``/v1/tessera/train`` is a training job (``tessera jobs submit --train``): its
lines are training runs, admitted and run by the same policy, trained by the batch workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, Request, Response, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from libs.contracts.batch_requests import TRAIN_ENDPOINT
from libs.core.batch_policies import Batch, Lane, admit_batch, edge_lane
from libs.core.deadlines import Admission
from services.gateway.batches.lines import LineError, read_lines, window_seconds
from services.gateway.batches.runner import BatchRunner
from services.gateway.batches.store import JobStore
from services.gateway.core.errors import ApiError, documented
from services.gateway.settings import GatewaySettings

ERRORS = documented(400, 401, 404, 413, 503)
#: What a batch's requests make, where not tokens.
UNITS = {"/v1/embeddings": "requests", TRAIN_ENDPOINT: "training steps"}

log = logging.getLogger(__name__)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: Annotated[str, Field(min_length=1, max_length=128)]
    endpoint: Literal[
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
        "/v1/tessera/train",
    ]  # fmt: skip
    completion_window: Annotated[str, Field(min_length=2, max_length=16)]
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None


def runner_of(request: Request) -> BatchRunner:
    found: BatchRunner = request.app.state.batches
    return found


def batches_router(settings: GatewaySettings) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["batches"])

    @router.post("/files", responses=ERRORS)
    async def create_file(
        request: Request, file: UploadFile, purpose: Annotated[str, Form(min_length=1)]
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise ApiError(
                400, f"purpose {purpose!r}: only 'batch' files are taken", param="purpose"
            )
        content = await file.read()
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = f"the file is not UTF-8 text (byte {exc.start}): a batch file is JSONL"
            raise ApiError(400, message, param="file") from None
        return await runner_of(request).store.add_file(content, file.filename or "", purpose)

    @router.get("/files", responses=ERRORS)
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    ) -> dict[str, Any]:
        files = await runner_of(request).store.files(limit)
        data = [f for f in files if purpose is None or f["purpose"] == purpose]
        return {"object": "list", "data": data, "has_more": False}

    @router.get("/files/{file_id}", responses=ERRORS)
    async def get_file(request: Request, file_id: str) -> dict[str, Any]:
        found = await runner_of(request).store.file(file_id)
        if found is None:
            raise ApiError(404, f"no file {file_id!r}", code="file_not_found")
        return found

    @router.get("/files/{file_id}/content", responses=ERRORS)
    async def file_content(request: Request, file_id: str) -> Response:
        content = await runner_of(request).store.content(file_id)
        if content is None:
            raise ApiError(404, f"no file {file_id!r}", code="file_not_found")
        return Response(content, media_type="application/octet-stream")

    @router.delete("/files/{file_id}", responses=ERRORS)
    async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
        if not await runner_of(request).store.delete_file(file_id):
            raise ApiError(404, f"no file {file_id!r}", code="file_not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/batches", responses=ERRORS)
    async def create_batch(request: Request, body: BatchCreate) -> dict[str, Any]:
        return await create(request, body, settings)

    @router.get("/batches", responses=ERRORS)
    async def list_batches(
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> dict[str, Any]:
        store = runner_of(request).store
        ids = await store.batch_ids(limit + 1, after)
        data = [b for b in [await store.batch(i) for i in ids[:limit]] if b is not None]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ids) > limit,
        }

    @router.get("/batches/{batch_id}", responses=ERRORS)
    async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
        return await _batch(runner_of(request).store, batch_id)

    @router.post("/batches/{batch_id}/cancel", responses=ERRORS)
    async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
        runner = runner_of(request)
        await _batch(runner.store, batch_id)  # 404 for no such batch
        await runner.store.cancel(batch_id)
        runner.wake.set()
        return await _batch(runner.store, batch_id)

    return router


async def create(
    request: Request,
    body: BatchCreate,
    settings: GatewaySettings,
    where: Callable[[int], str] = lambda n: f"line {n}",
) -> dict[str, Any]:
    """A batch of the file's requests, checked whole, then admitted or declined (a 400 with
    the reason); ``where`` names a faulty request by its line (Anthropic's: its index)."""
    runner = runner_of(request)
    try:
        window = window_seconds(body.completion_window)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="completion_window") from None
    content = await runner.store.content(body.input_file_id)
    if content is None:
        raise ApiError(404, f"no file {body.input_file_id!r}", param="input_file_id")
    try:
        # Read apart from the event loop: 50,000 lines take a while to check.
        lines = await asyncio.to_thread(read_lines, content, body.endpoint, settings.max_body_bytes)
    except LineError as exc:
        message = f"{where(exc.line)}: {exc.cause}" if exc.line else exc.cause
        raise ApiError(400, message, param="input_file_id", code="invalid_batch_line") from None
    model = str(lines[0].body["model"])
    if body.endpoint == TRAIN_ENDPOINT:  # trained by the batch workers, not served
        if not getattr(runner.send, "trains", False):
            message = (
                "training jobs run on batch workers, and this gateway sends its batches to "
                "none (set TESSERA_GATEWAY_BATCH_BROKER_URL, as tessera up does)"
            )
            raise ApiError(400, message, param="endpoint")
    else:
        try:
            await request.app.state.deployments.lookup(model)
        except ApiError as exc:
            message = f"{where(1)}: {exc.message}"
            raise ApiError(404, message, param="input_file_id", code="model_not_found") from None
    async with runner.admitting:  # one admission at a time: each sees the ones before it
        return await admitted(runner, body, lines, model, window)


async def admitted(
    runner: BatchRunner, body: BatchCreate, lines: list[Any], model: str, window: float
) -> dict[str, Any]:
    """The batch, created when its deadline can be met with every admitted one's; a 400 with
    the reason when not."""
    try:
        curve = await runner.curve(model, lines[0], body.endpoint)
    except ValueError as exc:
        raise ApiError(503, f"cannot measure {model}'s throughput: {exc}") from None
    now = time.time()
    units = sum(max(line.token_budget, 1) for line in lines)
    unit = UNITS.get(body.endpoint, "tokens")
    most = max(max(line.token_budget, 1) for line in lines)
    before, in_flight, busy = await runner.batches_now()
    new = Batch("this batch", len(lines), most, now + window, now, curve)
    # Planned from when the longest request in flight may have ended.
    decision = admit_batch(runner.policy, before, new, now + in_flight, runner.concurrency)
    at_once = max(new.curve(runner.concurrency), default=0)
    measured = f"{units} {unit}; {curve.get(at_once, 0.0):.1f}/s measured at {at_once} at once"
    lane = ""
    if not decision.admitted and runner.policy == "edgeflow":
        on_edge = await edge(runner, new, lines[0], body.endpoint, busy)
        if on_edge is None:
            decision = Admission(False, decision.planned_finish_s, decision.reason + (
                "; no edge deployment of it is free to end it in time"
            ))  # fmt: skip
        else:
            lane, decision, there = on_edge
            at_once = max((k for k in there if k <= runner.concurrency), default=0)
            rate = there.get(at_once, 0.0)
            measured = f"{units} {unit}; {rate:.1f}/s measured there at {at_once} at once"
    if not decision.admitted:
        message = f"batch declined ({runner.policy}): {decision.reason} ({measured})"
        raise ApiError(400, message, param="completion_window", code="deadline_unmeetable")
    batch_id = await runner.store.add_batch(
        {
            "endpoint": body.endpoint,
            "input_file_id": body.input_file_id,
            "completion_window": body.completion_window,
            "status": "in_progress",
            "in_progress_at": int(now),
            "expires_at": int(now + window),
            "planned_finish_at": int(decision.planned_finish_s),
            "metadata": body.metadata,
            "model": model,
            "total": len(lines),
            "decision": f"admitted ({runner.policy}): {decision.reason} ({measured})",
            "lane": lane,
            **({"steps_total": units} if body.endpoint == TRAIN_ENDPOINT else {}),
        }
    )
    runner.wake.set()
    return await _batch(runner.store, batch_id)


async def edge(
    runner: BatchRunner, new: Batch, sample: Any, endpoint: str, busy: set[str]
) -> tuple[str, Admission, Mapping[int, float]] | None:
    """EdgeFlow's edge for a batch the cloud declined: the model's edge deployments not
    ``busy``, each's curve measured (on ``sample`` the first time), the one ``edge_lane``
    picks from now (an idle copy has no request in flight to wait for), and its curve."""
    lanes = []
    for deployment in runner.lanes(str(sample.body["model"])):
        if deployment in busy:
            continue
        try:
            lanes.append(Lane(deployment, await runner.curve(deployment, sample, endpoint)))
        except Exception:  # it stopped serving, or failed its samples: not a lane now
            log.warning("edge deployment not measured", extra={"deployment": deployment})
            continue
    taken = edge_lane(new, lanes, time.time(), runner.concurrency)
    if taken is None:
        return None
    chosen, decision = taken
    return chosen, decision, next(ln.rates for ln in lanes if ln.deployment_id == chosen)


async def _batch(store: JobStore, batch_id: str) -> dict[str, Any]:
    found = await store.batch(batch_id)
    if found is None:
        raise ApiError(404, f"no batch {batch_id!r}", code="batch_not_found")
    return found
