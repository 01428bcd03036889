"""How the batch runner sends a request: through the gateway's own application in this
process (``AsgiSender``), or as a Celery task a batch worker runs (``CelerySender``: the
wire is ``libs/contracts/batch_requests.py``). Either way the request carries the runner's key
and its id in ``REQUEST_HEADER``, so the gateway counts it apart and can preempt it
(``preempt.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from celery import Celery
from redis.asyncio import Redis
from redis.exceptions import RedisError

from libs.contracts.batch_requests import (
    ABANDONED,
    ALIVE_S,
    DEVICES_HEADER,
    KEEP_S,
    QUEUE,
    REQUEST_HEADER,
    TASK,
    Answer,
    alive_key,
    answer_key,
    answer_of,
    claim_key,
    loads,
    steps_key,
    stop_key,
)

log = logging.getLogger(__name__)

#: Sends one request body to an endpoint of the gateway; its status, JSON answer and the
#: devices that answered it.
Send = Callable[[str, dict[str, Any]], Awaitable[Answer]]


class AsgiSender:
    """Sends each request through the gateway's own application in this process (its keys,
    limits, metrics and traces), with the runner's key."""

    #: Never sent again here (``CelerySender`` counts its own); no training runs.
    resent = lost = 0
    trains = False

    def __init__(self, app: Any, key: str) -> None:
        transport = httpx.ASGITransport(app=app)
        self.client = httpx.AsyncClient(
            transport=transport, base_url="http://gateway", timeout=None
        )
        self.headers = {"authorization": f"Bearer {key}"}

    async def __call__(self, endpoint: str, body: dict[str, Any]) -> Answer:
        headers = {**self.headers, REQUEST_HEADER: uuid.uuid4().hex}
        answer = await self.client.post(endpoint, json=body, headers=headers)
        return answer_of(answer.status_code, answer.text, answer.headers.get(DEVICES_HEADER, ""))

    async def aclose(self) -> None:
        await self.client.aclose()


class CelerySender:
    """Puts each request on the Celery queue ``batch.requests`` and waits for its answer.

    A request no worker took within ``pickup_s`` (none runs, or it sat in a killed worker's
    prefetch) is given up (its claim marked abandoned, so it never runs later) and sent again as
    a new task, ``pickups`` times at most: then it is answered 503 (no batch worker). One whose
    worker stopped beating (killed mid-request) is stopped at the gateway and answered 503;
    the runner sends either again as it does a server error. Cancelled (the runner preempts
    it), the request is given up and ``preempt`` stops it at the gateway. Either way its stop
    key is set, which ends a training run at its next step; a cancelled request ends once its
    worker has let it go. Redis out for a moment is waited out."""

    #: Training runs go to the batch workers too (``services/batch/train_runs.py``).
    trains = True

    def __init__(
        self,
        broker_url: str,
        prefix: str,
        preempt: Callable[[str], None],
        pickup_s: float = 30.0,
        pickups: int = 3,
        poll_s: float = 0.1,
    ) -> None:
        self.celery = Celery("tessera-gateway", broker=broker_url)
        self.celery.conf.update(task_serializer="json", accept_content=["json"])
        self.redis = Redis.from_url(broker_url)
        self.prefix, self.preempt, self.pickup_s, self.poll_s = prefix, preempt, pickup_s, poll_s
        self.pickups = pickups
        #: Tasks sent again because no worker took them; tasks whose worker was lost.
        self.resent = self.lost = 0

    async def __call__(self, endpoint: str, body: dict[str, Any]) -> Answer:
        for _ in range(self.pickups):
            task_id = f"batchreq-{uuid.uuid4().hex}"
            try:
                await asyncio.to_thread(
                    self.celery.send_task,
                    TASK,
                    kwargs={"endpoint": endpoint, "body": body},
                    queue=QUEUE,
                    task_id=task_id,
                )
                answer = await self.wait(task_id)
            except asyncio.CancelledError:
                self.preempt(task_id)
                with contextlib.suppress(Exception):  # the claim blocks a late run
                    if not await asyncio.shield(self.abandon(task_id, stop=True)):
                        await asyncio.shield(self.let_go(task_id))  # a worker had it
                raise
            if answer is not None:
                return answer
            self.resent += 1
            log.warning("no batch worker took a request; sent again", extra={"task": task_id})
        message = f"no batch worker took the request in {self.pickups * self.pickup_s:.0f} s"
        return 503, {"error": {"message": message}}, []

    async def wait(self, task_id: str) -> Answer | None:
        """The task's answer; None when no worker took it in time (send it again)."""
        keys = [answer_key(self.prefix, task_id), claim_key(self.prefix, task_id)]
        keys.append(alive_key(self.prefix, task_id))
        sent = time.monotonic()
        while True:
            try:
                answer, claim, alive = await self.redis.mget(keys)
            except RedisError as exc:  # out for a moment: the worker's answer waits there
                log.warning("broker unreachable; waiting", extra={"error": repr(exc)})
                await asyncio.sleep(1.0)
                continue
            if answer is not None:
                with contextlib.suppress(RedisError):
                    await self.redis.delete(keys[0])
                return loads(answer)
            if claim is not None and alive is None and claim != ABANDONED.encode():
                self.lost += 1  # its worker died mid-request: stop what it left running
                self.preempt(task_id)
                with contextlib.suppress(RedisError):  # (a worker cut off, not dead)
                    await self.stop(task_id)
                return 503, {"error": {"message": "the batch worker running it was lost"}}, []
            late = claim is None and time.monotonic() - sent > self.pickup_s
            if late and await self.abandon(task_id):
                self.preempt(task_id)  # should it reach the gateway after all
                return None  # (else a worker took it just now: wait on)
            await asyncio.sleep(self.poll_s)

    async def stop(self, task_id: str) -> None:
        """Set the task's stop key: a training run a worker runs ends at its next step."""
        await self.redis.set(stop_key(self.prefix, task_id), 1, ex=KEEP_S)

    async def let_go(self, task_id: str) -> None:
        """Until the worker running the task has stopped it (its beat gone), ``ALIVE_S`` and
        a little more at most: a cancelled request ends once nothing runs it any more."""
        key, deadline = alive_key(self.prefix, task_id), time.monotonic() + ALIVE_S + 2.0
        while time.monotonic() < deadline and await self.redis.exists(key):
            await asyncio.sleep(self.poll_s)

    async def steps(self, runs: list[str]) -> list[int | None]:
        """Each training run's last step its worker reported (None: none yet, or Redis out
        for a moment)."""
        if not runs:
            return []
        try:
            found = await self.redis.mget([steps_key(self.prefix, run) for run in runs])
        except RedisError:
            return [None] * len(runs)
        return [None if v is None else int(v) for v in found]

    async def abandon(self, task_id: str, stop: bool = False) -> bool:
        """Mark the task given up, unless a worker claimed it first; with ``stop``, stop
        it (a training run ends) should a worker run it."""
        if stop:
            await self.stop(task_id)
        key = claim_key(self.prefix, task_id)
        return bool(await self.redis.set(key, ABANDONED, nx=True, ex=KEEP_S))

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        await asyncio.to_thread(self.celery.close)
