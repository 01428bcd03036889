"""Runs the admitted batches: each request through the gateway's own API, earliest deadline
first, at most ``concurrency`` at once (the rest of the gateway's requests stay for
interactive clients), answers kept as they come (``store.py``).

One gateway at a time runs batches (a lease in Redis); a gateway that restarts, or another
that takes the lease, goes on with the requests not yet answered. A request refused for
capacity (429) is sent again until the deadline, one that met a server error (5xx) up to
``MAX_ATTEMPTS`` times; one the API refuses is answered with that error. At its
deadline (``expires_at``) a batch ends ``expired``; a cancelled one ends once its requests in
flight are answered. Either way each request not answered is written to the error file with
the reason, so every ``custom_id`` appears exactly once in the output or the error file.

The throughput of each model is measured here (tokens, or requests where no token is made,
per second over the batches' requests of that model), kept in Redis, and read by admission.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from libs.core.deadlines import Work
from services.gateway.batches.lines import BatchLine, read_lines
from services.gateway.batches.store import JobStore

log = logging.getLogger(__name__)

#: Sends one request body to an endpoint of the gateway; its status and JSON answer.
Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
LEASE_S = 10.0
#: Server errors sent again rather than written as the request's answer, and how often.
RETRIED = (500, 502, 503, 504)
MAX_ATTEMPTS = 5
EXPIRED = "This request could not be executed before the completion window expired."
CANCELLED = "The batch was cancelled before this request ran."


class BatchRunner:
    def __init__(self, store: JobStore, send: Send, concurrency: int) -> None:
        self.store, self.send, self.concurrency = store, send, concurrency
        self.holder = uuid.uuid4().hex
        self.wake = asyncio.Event()
        self.flying: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.attempts: dict[tuple[str, str], int] = {}
        #: What this runner knows while it holds the lease (read again when it takes it).
        self._lines: dict[str, list[BatchLine]] = {}
        self._answered: dict[str, set[str]] = {}
        self._holding = False
        #: Per model: (units done, seconds busy) since this gateway started, for the rate.
        self._measured: dict[str, tuple[float, float]] = {}

    # -- what admission reads -----------------------------------------------------------------
    async def lines(self, batch: dict[str, Any]) -> list[BatchLine]:
        if batch["id"] not in self._lines:
            content = await self.store.content(batch["input_file_id"]) or b""
            lines = await asyncio.to_thread(read_lines, content, batch["endpoint"])
            self._lines[batch["id"]] = lines
        return self._lines[batch["id"]]

    async def answered(self, batch_id: str) -> set[str]:
        if batch_id not in self._answered:
            self._answered[batch_id] = await self.store.answered(batch_id)
        return self._answered[batch_id]

    async def rate(self, model: str, sample: BatchLine, endpoint: str) -> float:
        """Units (tokens made, or requests that make none) per second for ``model``: measured
        by earlier batches, else measured now on ``sample`` (not kept as its answer)."""
        known = await self.store.rate(model)
        if known:
            return known
        body = {**sample.body}
        if endpoint != "/v1/embeddings":
            body["max_tokens"] = min(sample.token_budget or 32, 32)
            body.pop("max_completion_tokens", None)
        started = time.monotonic()
        status, answer = await self.send(endpoint, body)
        if status != 200:
            raise ValueError(f"the model answered a sample request with {status}: {answer}")
        return _units(answer) / max(time.monotonic() - started, 1e-3)

    async def pending_work(self) -> list[Work]:
        """What the admitted, unfinished batches still need, in seconds at their rates."""
        works = []
        for batch in await self.active():
            lines = await self.lines(batch)
            answered = await self.answered(batch["id"])
            units = sum(max(ln.token_budget, 1) for ln in lines if ln.custom_id not in answered)
            rate = await self.store.rate(batch["model"]) or 1.0
            works.append(Work(batch["id"], units / rate, float(batch["expires_at"])))
        return works

    async def active(self) -> list[dict[str, Any]]:
        """Unfinished batches, earliest deadline first."""
        out = []
        for batch_id in await self.store.active_ids():
            raw = await self.store.raw(batch_id)
            if raw is not None and raw["status"] in ("in_progress", "finalizing", "cancelling"):
                out.append(raw)
        return sorted(out, key=lambda b: (b["expires_at"], b["id"]))

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                holding = await self.store.lease(self.holder, LEASE_S)
                if holding and not self._holding:  # another gateway may have run batches
                    self._lines.clear()
                    self._answered.clear()
                self._holding = holding
                if holding:
                    await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch runner step failed; trying again")
            self.wake.clear()
            waiting = [t for t in self.flying.values() if not t.done()]
            wake = asyncio.create_task(self.wake.wait())
            await asyncio.wait([wake, *waiting], timeout=0.5, return_when="FIRST_COMPLETED")
            wake.cancel()

    async def close(self) -> None:
        for task in self.flying.values():
            task.cancel()
        await asyncio.gather(*self.flying.values(), return_exceptions=True)

    async def step(self) -> None:
        self.flying = {k: t for k, t in self.flying.items() if not t.done()}
        for batch in await self.active():
            batch_id = batch["id"]
            mine = [k for k in self.flying if k[0] == batch_id]
            if time.time() >= batch["expires_at"]:
                for key in mine:
                    self.flying.pop(key).cancel()
                await self.finish(batch, "expired", EXPIRED, "batch_expired")
                continue
            lines = await self.lines(batch)
            answered = await self.answered(batch_id)
            pending = [
                ln
                for ln in lines
                if ln.custom_id not in answered and (batch_id, ln.custom_id) not in self.flying
            ]
            if batch["status"] == "cancelling" or batch.get("ending") == "cancelled":
                if not mine:
                    await self.finish(batch, "cancelled", CANCELLED, "batch_cancelled")
                continue
            if not pending and not mine:
                await self.finish(batch, "completed", "", "")
                continue
            for line in pending:
                if len(self.flying) >= self.concurrency:
                    return
                key = (batch_id, line.custom_id)
                self.flying[key] = asyncio.create_task(self.one(batch, line))

    async def one(self, batch: dict[str, Any], line: BatchLine) -> None:
        key = (batch["id"], line.custom_id)
        started = time.monotonic()
        try:
            status, answer = await self.send(batch["endpoint"], line.body)
        except Exception as exc:  # the gateway's own error: sent again, as a 503 would be
            log.warning("batch request failed", extra={"batch": batch["id"], "error": str(exc)})
            status, answer = 503, {"error": {"message": str(exc)}}
        tries = self.attempts.get(key, 0) + 1
        # Busy (429: interactive requests hold the gateway's places) is waited out until the
        # deadline; a server error is tried ``MAX_ATTEMPTS`` times.
        if status == 429 or (status in RETRIED and tries < MAX_ATTEMPTS):
            self.attempts[key] = tries
            await asyncio.sleep(min(8.0, 0.5 * 2 ** min(tries, 4)))
            return  # pending again: the next step sends it
        self.attempts.pop(key, None)
        out = {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": answer.get("id", ""), "body": answer},
            "error": None,
        }
        kept = await self.store.answer(batch["id"], line.custom_id, out, ok=status == 200)
        (await self.answered(batch["id"])).add(line.custom_id)
        if kept and status == 200:
            await self.measured(batch, _units(answer), time.monotonic() - started)
        self.wake.set()

    async def measured(self, batch: dict[str, Any], units: float, seconds: float) -> None:
        """Count a request's units toward its model's rate: the units of all of this runner's
        requests of that model over the time they ran, ``concurrency`` at once."""
        model = batch["model"]
        done, busy = self._measured.get(model, (0.0, 0.0))
        alongside = sum(1 for k, t in self.flying.items() if k[0] == batch["id"] and not t.done())
        done, busy = done + units, busy + seconds / max(1, alongside)
        self._measured[model] = (done, busy)
        rate = done / max(busy, 1e-3)
        await self.store.set_rate(model, rate)
        lines = await self.lines(batch)
        answered = await self.answered(batch["id"])
        left = sum(max(ln.token_budget, 1) for ln in lines if ln.custom_id not in answered)
        await self.store.update(batch["id"], planned_finish_at=int(time.time() + left / rate))

    async def finish(self, batch: dict[str, Any], status: str, message: str, code: str) -> None:
        """Write the output and error files and end the batch as ``status``; each request not
        answered gets ``code`` in the error file."""
        batch_id = batch["id"]
        now = int(time.time())
        await self.store.update(batch_id, status="finalizing", finalizing_at=now, ending=status)
        lines = await self.lines(batch)
        answered = await self.store.answered(batch_id)  # from Redis: the whole truth
        for line in lines:
            if line.custom_id not in answered:
                out = {
                    "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                    "custom_id": line.custom_id,
                    "response": None,
                    "error": {"code": code, "message": message},
                }
                await self.store.answer(batch_id, line.custom_id, out, ok=False)
        files: dict[str, str | None] = {}
        for ok, field in ((True, "output_file_id"), (False, "error_file_id")):
            kept = await self.store.answers(batch_id, ok)
            rows = [kept[ln.custom_id] for ln in lines if ln.custom_id in kept]
            files[field] = None
            if rows:
                name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                content = "".join(r + "\n" for r in rows).encode()
                files[field] = (await self.store.add_file(content, name, "batch_output"))["id"]
        await self.store.ended(batch_id, status=status, **{f"{status}_at": now}, **files)
        self._lines.pop(batch_id, None)
        self._answered.pop(batch_id, None)
        log.info("batch ended", extra={"batch": batch_id, "status": status})


def _units(answer: dict[str, Any]) -> float:
    """What a request made: its completion tokens, or 1 for a request that makes none."""
    usage = answer.get("usage") or {}
    return float(max(int(usage.get("completion_tokens") or 0), 1))


class AsgiSender:
    """Sends each request through the gateway's own application in this process (its keys,
    limits, metrics and traces), with the runner's key."""

    def __init__(self, app: Any, key: str) -> None:
        transport = httpx.ASGITransport(app=app)
        self.client = httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=None
        )
        self.headers = {"authorization": f"Bearer {key}"}

    async def __call__(self, endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        answer = await self.client.post(endpoint, json=body, headers=self.headers)
        try:
            parsed = answer.json()
        except ValueError:
            parsed = {"error": {"message": answer.text[:500]}}
        return answer.status_code, parsed if isinstance(parsed, dict) else {"data": parsed}

    async def aclose(self) -> None:
        await self.client.aclose()
