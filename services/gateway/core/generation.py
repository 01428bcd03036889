"""The owner's side of a generation: send it to a deployment, stream its tokens, survive moves.

``GenerationClient.stream`` sends a request to the first shard of the route the scheduler
placed it on (``Deployed``, the deployment book, knows where each deployment runs now) and
yields its ``TokenChunk``s in order.
When the deployment moves (a device failed and the scheduler re-placed it under a new epoch)
it sends the request again to the new placement with the tokens already streamed, so the model
continues after them; chunks of the old epoch and repeats are dropped, so the caller sees one
complete stream. What to do at each turn is decided by ``StreamState`` (no I/O); ``stream`` is
the I/O around it: the bus, the inbox, the clock and the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from libs.contracts import (
    CANCEL,
    GENERATION,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    TOKENS,
    ContractError,
    GenerationCancel,
    GenerationRequest,
    InferenceRequest,
    PlacementDecision,
    PlacementRequest,
    Prompt,
    Sampling,
    TokenChunk,
)
from libs.runtime.bus import Bus, Delivery, Rejected
from services.gateway.core.deployed import Deployed, Inbox, Moved, Resend, Route
from services.gateway.core.stream_state import (
    ACK_S,
    Arrived,
    AskAgain,
    Emit,
    End,
    Event,
    Fail,
    Follow,
    Reconnected,
    RouteNews,
    Send,
    StreamState,
    TimedOut,
)

log = logging.getLogger(__name__)


def loading(reason: str | None) -> bool:
    """Whether the scheduler did not place a request only because its deployment is still
    loading: its answer names each copy ``<id> <phase> (<progress>)`` (services/scheduler/
    routing.py), and a pending or loading one will serve."""
    if reason is None or not reason.startswith("not_serving:"):
        return False
    return " pending (" in reason or " loading (" in reason


async def next_item(queue: Inbox, wait: float) -> TokenChunk | Moved | Resend:
    """The queue's next item, waiting ``wait`` seconds at most (``TimeoutError``). One that is
    there already is taken without a timer (``wait_for`` starts a task per call: per token)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(wait):
        return await queue.get()


class GenerationError(RuntimeError):
    pass


class GenerationClient:
    def __init__(
        self,
        bus: Bus,
        routes: Deployed,
        *,
        stall_s: float = 60.0,
        move_s: float = 5.0,
        place_s: float = 1.0,
        rejected: Rejected | None = None,
    ) -> None:
        self.bus = bus
        self.rejected = rejected
        self.routes = routes
        #: How long to wait for the scheduler's answer to a request's placement.
        self.place_s = place_s
        #: Give up when nothing arrives for this long and the deployment does not move.
        self.stall_s = stall_s
        #: How long a request on a failed device waits for the scheduler to re-place it.
        self.move_s = move_s

    async def stream(
        self,
        deployment_id: str,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        prompt: Prompt | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Yield the request's chunks, ending with the finished one (or an error chunk).

        With ``prompt`` (the request as OpenAI's fields) an engine that applies the model's
        own template answers in pieces (text, whole tool calls); after a move it runs the
        request again with the same seed and sends only the pieces after those streamed."""
        size = len(prompt_token_ids) or (len(prompt.body) // 4 if prompt is not None else 1)
        placed = await self.place_serving(deployment_id, request_id, size, sampling)
        if placed is not None and not placed.placed:
            message = f"no capacity: {placed.reason}"
            yield TokenChunk.failure(request_id, 0, placed.epoch, message, time.time())
            return
        if placed is not None and placed.deployment_id is not None:
            deployment_id = placed.deployment_id  # the replica the scheduler chose
        # The placement answered for this request is its route; else where the book says the
        # deployment serves (the scheduler did not answer in time).
        route = (
            Route.of(placed, deployment_id)
            if placed is not None
            else self.routes.route(deployment_id)
        )
        if route is None:
            raise GenerationError(f"deployment {deployment_id!r} is not placed")
        queue: Inbox = asyncio.Queue()
        state = StreamState(route, self.stall_s, self.move_s, pieces=prompt is not None)

        async def on_chunk(chunk: TokenChunk, msg: Delivery) -> None:
            # Only a device of the request's route (as this stream follows it, or as the book
            # has it already) may write into its answer: another device's chunk is refused.
            sender = TOKENS.token_of(msg.subject, "device_id")
            current = self.routes.route(deployment_id)
            routed = [r.devices for r in (state.route, current) if r is not None]
            if any(sender in devices for devices in routed):
                queue.put_nowait(chunk)
            elif self.rejected is not None:
                self.rejected(TOKENS.name, "not_routed", f"a chunk from {sender}")

        sub = await self.bus.subscribe(
            TOKENS,
            on_chunk,
            subject=TOKENS.pattern(request_id=request_id),
            rejected=self.rejected,
        )
        self.routes.listen(deployment_id, queue)
        try:
            while True:
                loading = self.routes.loading(deployment_id)
                action = state.step(time.monotonic(), self.routes.down, loading)
                if isinstance(action, Send):
                    taken = await self._send(action, request_id, prompt_token_ids, sampling, prompt)
                    loading = self.routes.loading(deployment_id)
                    action = state.sent(taken, time.monotonic(), loading)
                event: Event
                try:
                    item = await next_item(queue, action.seconds)
                except TimeoutError:
                    event = TimedOut()
                else:
                    if isinstance(item, Moved):
                        event = RouteNews(self.routes.route(deployment_id))
                    elif isinstance(item, Resend):
                        event = Reconnected()
                    else:
                        event = Arrived(item)
                outcome = state.handle(event, time.monotonic())
                if isinstance(outcome, Emit | End):
                    yield outcome.chunk
                    if isinstance(outcome, End):
                        return
                elif isinstance(outcome, Fail):
                    yield TokenChunk.failure(
                        request_id, outcome.index, outcome.epoch, outcome.message, time.time()
                    )
                    return
                elif isinstance(outcome, Follow):
                    log.warning(
                        "following the deployment to its new placement",
                        extra={
                            "request_id": request_id,
                            "epoch": outcome.route.epoch,
                            "devices": list(outcome.route.devices),
                            "resume_after": len(state.generated),
                        },
                    )
                elif isinstance(outcome, AskAgain) and outcome.reason == "lost":
                    log.warning(
                        "tokens lost on the way; asking again",
                        extra={"request_id": request_id, "resume_after": len(state.generated)},
                    )
        finally:
            self.routes.unlisten(deployment_id, queue)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if not state.finished:
                await self.cancel(state.route.deployment_id, request_id)

    async def place_serving(
        self, deployment_id: str, request_id: str, prompt_tokens: int, sampling: Sampling
    ) -> PlacementDecision | None:
        """``place``; while the deployment is still loading (just deployed, or re-placed after
        a failure: the scheduler routes only to copies that serve) it waits for a copy to
        serve (its status says so, or a second passes) and asks again, ``stall_s`` at most."""
        deadline = time.monotonic() + self.stall_s
        while True:
            # Listening before asking: a status that comes between the answer and the wait
            # is not missed (it would cost the second the wait falls back on).
            queue: Inbox = asyncio.Queue()
            self.routes.listen(deployment_id, queue)
            try:
                placed = await self.place(deployment_id, request_id, prompt_tokens, sampling)
                if placed is None or placed.placed or not loading(placed.reason):
                    return placed
                if time.monotonic() > deadline:
                    return placed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(queue.get(), 1.0)
            finally:
                self.routes.unlisten(deployment_id, queue)

    async def place(
        self, deployment_id: str, request_id: str, prompt_tokens: int, sampling: Sampling
    ) -> PlacementDecision | None:
        """Ask the scheduler where this request runs (a placement request on NATS). For a
        deployed model it answers at once with the placement of the replica it chose for this
        request: the request's route. ``None`` when it does not answer in time: the route the
        book knows is used."""
        task = InferenceRequest(
            request_id=request_id,
            model=deployment_id,
            deployment_id=deployment_id,
            prompt_tokens=prompt_tokens,
            max_tokens=sampling.max_tokens,
        )
        try:
            decision = await self.bus.request(
                PLACEMENT_REQUEST,
                PlacementRequest(task=task, ts=time.time()),
                PLACEMENT_DECISION,
                self.place_s,
            )
        except (TimeoutError, ContractError) as exc:
            log.warning("no placement answer; using the known route", extra={"error": str(exc)})
            return None
        return decision

    async def cancel(self, deployment_id: str, request_id: str) -> None:
        message = GenerationCancel(request_id=request_id, ts=time.time())
        with contextlib.suppress(Exception):
            await self.bus.publish(CANCEL, message, deployment_id=deployment_id)

    async def _send(
        self,
        send: Send,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        prompt: Prompt | None = None,
    ) -> bool:
        """Send the request to the route's first shard; True once that shard took it."""
        route = send.route
        request = GenerationRequest(
            request_id=request_id,
            deployment_id=route.deployment_id,
            epoch=route.epoch,
            prompt_token_ids=tuple(prompt_token_ids),
            # A prompt's pieces are not tokens: its re-run skips them (``delivered``).
            generated_token_ids=send.generated,
            sampling=sampling,
            ts=time.time(),
            prompt=prompt,
            delivered=send.delivered,
        )
        # The first shard acknowledges at once. Without an answer (its worker is reconnecting
        # after a NATS restart, or gone) the stream asks again shortly; a duplicate only
        # re-runs the request, and the repeated tokens are dropped by index.
        return await self.bus.ask(
            GENERATION, request, ACK_S, deployment_id=route.deployment_id, device_id=route.first
        )
