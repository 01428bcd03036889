"""Runs the admitted batches: each request through the gateway's own API, at most
``concurrency`` at once, each batch's share of them given by the policy (``edf``, ``fifo``,
``elasticflow`` or ``edgeflow``: ``libs/core/batch_policies.py``), answers kept as they come
(``store.py``). Under ``edgeflow`` a batch admitted on an edge deployment (its ``lane``) sends
every request to that deployment, with ``concurrency`` streams of its own, all the runner's
requests at most ``most`` at once; a 404 from the edge copy (it stopped serving) hands what
is left of the batch to the cloud.

Each request is sent by ``send`` (``sender.py``): through this process's own application, or
as a Celery task a batch worker runs (``python -m services.batch.worker``, what ``tessera up``
starts). Interactive requests come first. While any is in flight (``preempt.py`` tells the
runner's requests apart, wherever they come from), and for ``QUIET_S`` after the last, the
batches' requests are preempted (cancelled: sent again later, from the start) and no new one
starts, so a chat shares the devices with no batch; a batch whose deadline is near (what it
still needs, at its model's measured rate, ``URGENT_MARGIN`` times over, would reach its
deadline) runs on regardless, beside the chat.

One gateway at a time runs batches (a lease in Redis); a gateway that restarts, or another
that takes the lease, goes on with the requests not yet answered. A request refused for
capacity (429) is sent again until the deadline, one that met a server error (5xx) up to
``MAX_ATTEMPTS`` times; one the API refuses is answered with that error. At its
deadline (``expires_at``) a batch ends ``expired``; a cancelled one ends once its requests in
flight are answered. Either way each request not answered is written to the error file with
the reason, so every ``custom_id`` appears exactly once in the output or the error file.

A training job's requests are training runs (``/v1/tessera/train``), each trained whole by a
batch worker from its last checkpoint; one preempted, cancelled or expired is stopped at its
next step, checkpointed, and a preempted one resumes there when it is sent again.

The throughput of each model (and of each edge deployment) is measured here, by requests at
once (tokens, or requests where none is made, per second over the batches' requests of that
model running that many at once: a curve), kept in Redis, and read by admission and the shares.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from libs.contracts.batch_requests import TRAIN_ENDPOINT
from libs.core.batch_policies import ELASTIC, Batch, need_s, order, shares
from libs.runtime.cancelling import stopping
from services.gateway.batches.edge import rescue
from services.gateway.batches.lines import BatchLine, Progress, read_lines, run_name, units_made
from services.gateway.batches.sender import Send
from services.gateway.batches.store import JobStore
from services.gateway.batches.train_progress import write_steps

log = logging.getLogger(__name__)

LEASE_S = 10.0
#: Seconds without an interactive request before batches run again.
QUIET_S = 1.0
#: A batch runs beside interactive requests once this many times what it still needs would
#: reach its deadline.
URGENT_MARGIN = 1.5
#: Server errors sent again rather than written as the request's answer, and how often.
RETRIED = (500, 502, 503, 504)
MAX_ATTEMPTS = 5
EXPIRED = "This request could not be executed before the completion window expired."
CANCELLED = "The batch was cancelled before this request ran."
#: The steps of a training run's sample (measuring its rate).
SAMPLE_STEPS = 200


class BatchRunner:
    def __init__(
        self,
        store: JobStore,
        send: Send,
        concurrency: int,
        busy: Callable[[], int] = lambda: 0,
        policy: str = "edf",
        lanes: Callable[[str], list[str]] = lambda model: [],
        most: int | None = None,
    ) -> None:
        """``busy``: the gateway's interactive requests in flight now (not the runner's);
        ``lanes``: a model's edge deployments (``edgeflow``: the other deployments of it that
        serve); ``most``: the runner's requests in flight at once, edge ones with the cloud's
        (default ``concurrency``)."""
        self.store, self.send, self.concurrency, self.busy = store, send, concurrency, busy
        self.policy, self.lanes, self.most = policy, lanes, most or concurrency
        #: When an interactive request was last seen; how many of the runner's were preempted.
        self.chat_seen = -math.inf
        self.preempted = 0
        self.holder = uuid.uuid4().hex
        self.wake = asyncio.Event()
        self.admitting = asyncio.Lock()
        #: The requests in flight, by (batch, custom id): the task and its line.
        self.flying: dict[tuple[str, str], tuple[asyncio.Task[None], BatchLine]] = {}
        self.attempts: dict[tuple[str, str], int] = {}
        #: What this runner knows of each batch while it holds the lease (read again when it
        #: takes it), and when each one's planned end was last written.
        self._progress: dict[str, Progress] = {}
        self._planned: dict[str, float] = {}
        self._stepped: dict[str, float] = {}  # a training job's steps, when last written
        self._holding = False
        #: Per model and requests at once: (units done, seconds busy) since this gateway
        #: started, for the curve; when each model's was last written.
        self._measured: dict[tuple[str, int], tuple[float, float]] = {}
        self._written: dict[str, float] = {}

    # -- what admission reads -----------------------------------------------------------------
    async def progress(self, batch: dict[str, Any]) -> Progress:
        if batch["id"] not in self._progress:
            content = await self.store.content(batch["input_file_id"]) or b""
            lines = await asyncio.to_thread(read_lines, content, batch["endpoint"])
            answered = await self.store.answered(batch["id"])
            lane = str(batch.get("lane") or "")
            self._progress[batch["id"]] = Progress(lines, answered, batch["model"], lane)
        return self._progress[batch["id"]]

    def counts(self) -> list[int]:
        """The requests at once measured: ``concurrency`` (what edf and fifo run at), and
        for elasticflow's curve the powers of two below it too."""
        if self.policy not in ELASTIC:
            return [self.concurrency]
        below = [2**i for i in range(self.concurrency.bit_length()) if 2**i < self.concurrency]
        return [*below, self.concurrency]

    async def curve(self, model: str, sample: BatchLine, endpoint: str) -> dict[int, float]:
        """Units (tokens made, or requests that make none) per second for ``model`` (a
        model's name, or one of its deployments) by requests at once: measured by earlier
        batches, else measured now on copies of ``sample``, ``counts()`` at once in turn (none
        kept as an answer)."""
        known = await self.store.curve(model)
        if all(k in known for k in self.counts()):
            return known
        body = {**sample.body, "model": model}
        if endpoint == TRAIN_ENDPOINT:  # a short run of its own, kept nowhere
            body.update(steps=min(sample.token_budget, SAMPLE_STEPS), keep=False)
        elif endpoint != "/v1/embeddings":
            body["max_tokens"] = min(sample.token_budget or 32, 32)
            body.pop("max_completion_tokens", None)
        for at_once in self.counts():
            if at_once in known:
                continue
            started = time.monotonic()
            bodies = [body] * at_once
            if endpoint == TRAIN_ENDPOINT:  # each sample run a checkpoint of its own
                bodies = [{**body, "run": f"sample-{uuid.uuid4().hex}"} for _ in range(at_once)]
            answers = await asyncio.gather(*[self.send(endpoint, b) for b in bodies])
            for status, answer, _ in answers:
                if status != 200:
                    raise ValueError(f"the model answered a sample request with {status}: {answer}")
            made = sum(units_made(answer) for _, answer, _ in answers)
            known[at_once] = made / max(time.monotonic() - started, 1e-3)
            await self.store.set_rate(model, at_once, known[at_once])  # until batches measure
        return known

    async def batches_now(self) -> tuple[list[Batch], float, set[str]]:
        """The admitted, unfinished batches in the cloud as the policy sees them, in its
        order; the longest a request in flight may still take (a new batch may wait); and
        the edge deployments running a batch now (each runs one at a time)."""
        out, longest, lanes = [], 0.0, set()
        for raw, batch in await self.seen():
            if raw.get("lane"):
                lanes.add(str(raw["lane"]))
                continue
            out.append(batch)
            if any(key[0] == batch.job_id for key in self.flying) and batch.rates:
                k = max(batch.rates)
                longest = max(longest, need_s(1, batch.most, k, batch.rates[k]))
        return out, longest, lanes

    async def seen(self) -> list[tuple[dict[str, Any], Batch]]:
        """Each unfinished batch and how the policy sees it (each curve read once: its
        model's, or its edge deployment's), in the policy's order."""
        active = await self.active()
        keys = {raw["id"]: (await self.progress(raw)).key for raw in active}
        curves = {k: await self.store.curve(k) for k in set(keys.values())}
        pairs = [(raw, await self.batch(raw, curves[keys[raw["id"]]])) for raw in active]
        first = order(self.policy)
        return sorted(pairs, key=lambda pair: first(pair[1]))

    async def batch(self, raw: dict[str, Any], rates: dict[int, float]) -> Batch:
        """The batch as the policy sees it, at its model's ``rates``."""
        progress = await self.progress(raw)
        arrived = float(raw.get("created_at", raw["expires_at"]))
        return Batch(raw["id"], progress.left, progress.most, raw["expires_at"], arrived, rates)

    async def active(self) -> list[dict[str, Any]]:
        """Unfinished batches."""
        out = []
        for batch_id in await self.store.active_ids():
            raw = await self.store.raw(batch_id)
            if raw is not None and raw["status"] in ("in_progress", "finalizing", "cancelling"):
                out.append(raw)
        return out

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while not stopping():
            self.wake.clear()  # before the step: a request ending during it wakes the next
            try:
                holding = await self.store.lease(self.holder, LEASE_S)
                if holding and not self._holding:  # another gateway may have run batches
                    self._progress.clear()
                self._holding = holding
                if holding:
                    await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch runner step failed; trying again")
            waiting = [t for t, _ in self.flying.values() if not t.done()]
            wake = asyncio.create_task(self.wake.wait())
            await asyncio.wait([wake, *waiting], timeout=0.5, return_when="FIRST_COMPLETED")
            wake.cancel()

    async def close(self) -> None:
        tasks = [t for t, _ in self.flying.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drop(self, key: tuple[str, str], progress: Progress) -> None:
        """Stop a request in flight; it goes back to the front of its batch's queue."""
        task, line = self.flying.pop(key)
        task.cancel()
        if line.custom_id not in progress.answered:
            progress.queue.appendleft(line)

    async def step(self) -> None:
        self.flying = {k: v for k, v in self.flying.items() if not v[0].done()}
        if self.busy() > 0:
            self.chat_seen = time.monotonic()
        yielding = time.monotonic() - self.chat_seen < QUIET_S
        seen = await self.seen()
        if self.policy == "edgeflow":  # the cloud's late batches to idle edge copies
            await rescue(self.store, self.lanes, seen, self._progress, self.concurrency)
        cloud = [b for raw, b in seen if not raw.get("lane")]
        share = shares(self.policy, cloud, time.time(), self.concurrency)
        for batch, view in seen:
            batch_id = batch["id"]
            progress = await self.progress(batch)
            if batch["endpoint"] == TRAIN_ENDPOINT:  # its steps, about once a second
                await write_steps(self.store, self.send, batch, progress, self._stepped)
            if progress.lane:  # an edge deployment: all its streams, no chat shares it
                share[batch_id] = self.concurrency
            mine = [k for k in self.flying if k[0] == batch_id]
            if time.time() >= batch["expires_at"]:
                for key in mine:
                    self._drop(key, progress)
                await self.finish(batch, "expired", EXPIRED, "batch_expired")
                continue
            if batch["status"] == "cancelling" or batch.get("ending") == "cancelled":
                if batch["endpoint"] == TRAIN_ENDPOINT:  # a run is long: stopped now, and
                    for key in mine:  # the batch ends once its worker has stopped it
                        if not self.flying[key][0].cancelling():
                            self.flying[key][0].cancel()
                if not mine:
                    await self.finish(batch, "cancelled", CANCELLED, "batch_cancelled")
                continue
            if not progress.queue and not mine:
                await self.finish(batch, "completed", "", "")
                continue
            if yielding and not progress.lane and not self.urgent(view):
                for key in mine:  # preempted: sent again once the chat is done
                    self._drop(key, progress)
                    self.preempted += 1
                continue
            while (
                progress.queue and self.room(progress.lane) and len(mine) < share.get(batch_id, 0)
            ):
                line = progress.queue.popleft()
                if line.custom_id in progress.answered:
                    continue
                task = asyncio.create_task(self.one(batch, progress, line))
                self.flying[(batch_id, line.custom_id)] = (task, line)
                mine.append((batch_id, line.custom_id))

    def room(self, lane: str) -> bool:
        """Whether ``lane`` (an edge deployment, or "" for the cloud) may take one more
        request: each has ``concurrency`` streams, all of them ``most`` at once."""
        held = sum(
            1 for k in self.flying if (p := self._progress.get(k[0])) is not None and p.lane == lane
        )
        return held < self.concurrency and len(self.flying) < self.most

    async def one(self, batch: dict[str, Any], progress: Progress, line: BatchLine) -> None:
        key = (batch["id"], line.custom_id)
        started, lane = time.monotonic(), progress.lane
        try:
            body = {**line.body, "model": lane} if lane else line.body
            if batch["endpoint"] == TRAIN_ENDPOINT:  # each attempt resumes the same run
                body = {**body, "run": run_name(batch["id"], line.custom_id)}
            status, answer, devices = await self.send(batch["endpoint"], body)
            if lane and "model" in answer:  # the model's name, as the user sent it
                answer["model"] = line.body.get("model", answer["model"])
        except Exception as exc:  # the gateway's own error: sent again, as a 503 would be
            log.warning("batch request failed", extra={"batch": batch["id"], "error": str(exc)})
            status, answer, devices = 503, {"error": {"message": str(exc)}}, []
        tries = self.attempts.get(key, 0) + 1
        # Busy (429: interactive requests hold the gateway's places) is waited out until the
        # deadline, as is an edge copy gone (404: the next step gives the batch to the cloud);
        # a server error is tried ``MAX_ATTEMPTS`` times.
        if status == 404 and lane and progress.lane == lane:  # the edge copy is gone
            progress.lane = ""  # the cloud runs what is left of the batch
            await self.store.update(batch["id"], lane="")
            log.warning("edge copy gone", extra={"batch": batch["id"], "deployment": lane})
        gone = status == 404 and bool(lane)
        if status == 429 or gone or (status in RETRIED and tries < MAX_ATTEMPTS):
            self.attempts[key] = tries
            await asyncio.sleep(min(8.0, 0.5 * 2 ** min(tries, 4)))
            progress.queue.appendleft(line)  # pending again: the next step sends it
            self.wake.set()
            return
        self.attempts.pop(key, None)
        out = {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": answer.get("id", ""), "body": answer},
            "error": None,
        }
        kept = await self.store.answer(batch["id"], line.custom_id, out, ok=status == 200)
        progress.answer(line)
        if kept and devices:
            await self.store.add_devices(batch["id"], devices)
        if kept and status == 200:
            await self.measured(batch, progress, units_made(answer), time.monotonic() - started)
        self.wake.set()

    def urgent(self, batch: Batch) -> bool:
        """Whether the batch must run now to meet its deadline (see the module); with no
        rate measured (Redis lost it) it yields."""
        need = batch.seconds(self.concurrency)
        return math.isfinite(need) and time.time() + URGENT_MARGIN * need >= batch.deadline_s

    async def measured(
        self, batch: dict[str, Any], progress: Progress, units: float, seconds: float
    ) -> None:
        """Count a request's units toward its model's curve at the requests of that model
        running at once beside it: their units over the time they ran, shared among them;
        the model's curve and the batch's planned end written at most once a second each."""
        model = progress.key  # the model, or the edge deployment it runs on
        at_once = max(1, sum(
            1 for k, v in self.flying.items()
            if not v[0].done() and (p := self._progress.get(k[0])) is not None and p.key == model
        ))  # fmt: skip
        done, busy = self._measured.get((model, at_once), (0.0, 0.0))
        done, busy = done + units, busy + seconds / at_once
        self._measured[(model, at_once)] = (done, busy)
        if time.monotonic() - self._written.get(model, -math.inf) >= 1.0:
            self._written[model] = time.monotonic()
            for (measured, k), (units_done, busy_s) in self._measured.items():
                if measured == model:
                    await self.store.set_rate(model, k, units_done / max(busy_s, 1e-3))
        if time.monotonic() - self._planned.get(batch["id"], -math.inf) < 1.0:
            return
        self._planned[batch["id"]] = time.monotonic()
        left = await self.batch(batch, await self.store.curve(model))
        planned = time.time() + left.seconds(self.concurrency)
        if math.isfinite(planned):
            await self.store.update(batch["id"], planned_finish_at=int(planned))

    async def finish(self, batch: dict[str, Any], status: str, message: str, code: str) -> None:
        """Write the output and error files and end the batch as ``status``; each request not
        answered gets ``code`` in the error file."""
        batch_id = batch["id"]
        now = int(time.time())
        await self.store.update(batch_id, status="finalizing", finalizing_at=now, ending=status)
        lines = (await self.progress(batch)).lines
        answered = await self.store.answered(batch_id)  # from Redis: the whole truth
        unanswered = {
            line.custom_id: {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": line.custom_id,
                "response": None,
                "error": {"code": code, "message": message},
            }
            for line in lines
            if line.custom_id not in answered
        }
        await self.store.answer_many(batch_id, unanswered)
        if batch["endpoint"] == TRAIN_ENDPOINT:  # the steps as they ended
            await write_steps(self.store, self.send, batch, await self.progress(batch))
        files: dict[str, str | None] = {}
        for ok, name in ((True, "output_file_id"), (False, "error_file_id")):
            kept = await self.store.answers(batch_id, ok)
            rows = [kept[ln.custom_id] for ln in lines if ln.custom_id in kept]
            files[name] = None
            if rows:
                filename = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                content = "".join(r + "\n" for r in rows).encode()
                files[name] = (await self.store.add_file(content, filename, "batch_output"))["id"]
        await self.store.ended(batch_id, status=status, **{f"{status}_at": now}, **files)
        self._progress.pop(batch_id, None)
        self._planned.pop(batch_id, None)
        self._stepped.pop(batch_id, None)
        log.info("batch ended", extra={"batch": batch_id, "status": status})
