"""ASGI middleware: the batch runner's requests, known and preemptible wherever they come from.

A request with the runner's key and ``REQUEST_HEADER`` (its id) is the runner's, sent from
this process (``AsgiSender``) or by a Celery worker (``services/batch/requests.py``). It is
counted apart from interactive requests (``BATCH_REQUEST``, read by ``Completions``), and
``preempt(id)`` stops it: its handler is cancelled and it is answered 503 ``preempted``; an id
preempted before it arrived is answered so at once. The runner sends a preempted request again
later.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.contracts.batch_requests import REQUEST_HEADER
from services.gateway.core.completions import BATCH_REQUEST
from services.gateway.core.errors import error_response
from services.gateway.core.guards import presented_key

#: How long an id preempted before it arrived is remembered (s).
REMEMBER_S = 300.0


class BatchRequests:
    """The runner's requests being handled now, by id, and the ids preempted before they came."""

    def __init__(self, runner_key: str) -> None:
        self.runner_key = runner_key
        self.running: dict[str, asyncio.Task[None]] = {}
        self.early: dict[str, float] = {}

    def preempt(self, request_id: str) -> None:
        task = self.running.get(request_id)
        if task is not None:
            task.cancel()
            return
        now = time.monotonic()
        self.early = {k: t for k, t in self.early.items() if now - t < REMEMBER_S}
        self.early[request_id] = now

    def request_id(self, scope: Scope) -> str | None:
        """The runner's id of this request, when it carries the runner's key."""
        if scope["type"] != "http":
            return None
        request_id = Headers(scope=scope).get(REQUEST_HEADER)
        token = presented_key(scope)
        mine = token is not None and secrets.compare_digest(
            token.encode(), self.runner_key.encode()
        )
        return request_id if request_id and mine else None


class Preemptible:
    """The middleware: runs each of the runner's requests as a task ``requests`` can cancel,
    and cancels it when its sender goes away (a batch worker killed mid-request): nothing
    generates for an answer no one will read."""

    def __init__(self, app: ASGIApp, requests: BatchRequests) -> None:
        self.app, self.requests = app, requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = self.requests.request_id(scope)
        if request_id is None:
            await self.app(scope, receive, send)
            return
        if self.requests.early.pop(request_id, None) is not None:
            await preempted(scope, receive, send)
            return
        body = await whole_body(receive)
        if body is None:
            return  # the sender went away before it finished sending
        gone, started = asyncio.Event(), False

        async def replay() -> Message:  # the body, then (only) the sender going away
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            await gone.wait()
            return {"type": "http.disconnect"}

        async def sent(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def handle() -> None:
            await self.app(scope, replay, sent)

        mark = BATCH_REQUEST.set(True)  # the handler's task copies it
        try:
            task = asyncio.create_task(handle())
        finally:
            BATCH_REQUEST.reset(mark)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            task.cancel()

        watcher = asyncio.create_task(watch())
        self.requests.running[request_id] = task
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:  # the sender went away (the runner in this process)
            task.cancel()
            raise
        finally:
            watcher.cancel()
            self.requests.running.pop(request_id, None)
        if not task.cancelled():
            task.result()  # its error, if it raised one
        elif not started and not gone.is_set():
            await preempted(scope, receive, send)


async def whole_body(receive: Receive) -> bytes | None:
    """The request's body (a batch request's is one small JSON); None if the sender left."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def preempted(scope: Scope, receive: Receive, send: Send) -> None:
    message = "preempted by an interactive request; the batch runner sends it again"
    await error_response(503, message, "server_error", "preempted")(scope, receive, send)
