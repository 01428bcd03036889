"""The owner's side of a generation: send it to a deployment, stream its tokens, survive moves.

``RouteBook`` (``deployed``) knows where each deployment runs now (its epoch and devices in
shard order). ``GenerationClient.stream`` sends a request to the first shard and yields its
``TokenChunk``s in order. When the deployment moves (a device failed and the scheduler
re-placed it under a new epoch) it sends the request again to the new placement with the
tokens already streamed, so the model continues after them; chunks of the old epoch and
repeats are dropped, so the caller sees one complete stream.
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
from services.gateway.core.deployed import Inbox, Moved, Resend, Route, RouteBook

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


#: How often a request is sent again when its tokens go missing, before it fails.
RESENDS = 2
#: The first shard acknowledges a request within this long, or it is sent again (until the
#: stall timeout).
ACK_S = 0.5


class GenerationError(RuntimeError):
    pass


class GenerationClient:
    def __init__(
        self,
        bus: Bus,
        routes: RouteBook,
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
        route = self.routes.get(deployment_id)
        if route is None:
            raise GenerationError(f"deployment {deployment_id!r} is not placed")
        queue: Inbox = asyncio.Queue()

        async def on_chunk(chunk: TokenChunk, msg: Delivery) -> None:
            # Only a device of the request's route (as this stream follows it, or as the book
            # has it already) may write into its answer: another device's chunk is refused.
            sender = TOKENS.token_of(msg.subject, "device_id")
            current = self.routes.get(deployment_id)
            routed = [r.devices for r in (route, current) if r is not None]
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
        generated: list[int] = []
        finished = False
        try:
            sent = -1  # the epoch the request was last sent to (-1: send it again)
            resent = 0  # times it was sent again because tokens went missing on the way
            unacked: float | None = None  # since when no first shard has taken it
            down_since: float | None = None  # since when a device of its route is down
            while not finished:
                down = self.routes.down_in(route)
                # Since when its devices are down: news of other deployments or devices, or
                # of this one's phase, must not keep restarting the wait for a new route.
                down_since = (down_since or time.monotonic()) if down else None
                if not down and sent != route.epoch:
                    taken = await self._send(
                        route, request_id, prompt_token_ids, generated, sampling, prompt
                    )
                    sent = route.epoch
                    unacked = None if taken else (unacked or time.monotonic())
                if down and deployment_id in self.routes.loading:
                    wait = self.stall_s  # re-placed: its new plan loads, then it moves
                elif down:
                    wait = self.move_s
                else:
                    wait = ACK_S if unacked is not None else self.stall_s
                if down_since is not None:
                    wait = max(0.0, down_since + wait - time.monotonic())
                try:
                    item = await next_item(queue, wait)
                except TimeoutError:
                    waited = time.monotonic() - (unacked or 0.0)
                    if not down and unacked is not None and waited < self.stall_s:
                        sent = -1  # nobody took it yet (a worker reconnecting): ask again
                        continue
                    if not down and resent < RESENDS:  # its chunks were lost: ask again
                        resent, sent = resent + 1, -1
                        continue
                    message = (
                        f"no capacity: {', '.join(down)} failed and {deployment_id} could not be "
                        "placed elsewhere"
                        if down
                        else f"no token from {deployment_id} (epoch {route.epoch}) "
                        f"for {self.stall_s:.0f} s"
                    )
                    yield TokenChunk.failure(
                        request_id, len(generated), route.epoch, message, time.time()
                    )
                    return
                if isinstance(item, Resend):
                    sent = -1  # its request or tokens may be gone: send it again
                    continue
                if isinstance(item, Moved):
                    newer = self.routes.get(deployment_id)
                    if newer is not None and newer.epoch > route.epoch:
                        route = newer
                        log.warning(
                            "following the deployment to its new placement",
                            extra={
                                "request_id": request_id,
                                "epoch": route.epoch,
                                "devices": list(route.devices),
                                "resume_after": len(generated),
                            },
                        )
                    continue  # sent to the new placement at the top of the loop
                if item.epoch != route.epoch:
                    continue  # from the placement before the move
                unacked = None  # the placement is working on it
                if item.finished:
                    sent_n = item.index if prompt is not None else item.completion_tokens
                    missing = (sent_n or 0) > len(generated)
                    if missing and item.finish_reason != "error" and resent < RESENDS:
                        # A token was lost in transit (a server restart): run it again after
                        # the tokens that did arrive, rather than end the stream with a hole.
                        log.warning(
                            "tokens lost on the way; asking again",
                            extra={"request_id": request_id, "resume_after": len(generated)},
                        )
                        resent, sent = resent + 1, -1
                        continue
                    finished = True
                    if missing and item.finish_reason != "error":  # never a stream with a hole
                        message = f"tokens after {len(generated)} were lost on the way"
                        item = TokenChunk.failure(
                            request_id, len(generated), item.epoch, message, time.time()
                        )
                    yield item
                elif item.index == len(generated) and item.token_id is not None:
                    generated.append(item.token_id)
                    yield item
                elif item.index == len(generated) and prompt is not None:
                    generated.append(0)  # a piece: counted, its text is the user's already
                    yield item
        finally:
            self.routes.unlisten(deployment_id, queue)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if not finished:
                await self.cancel(route.deployment_id, request_id)

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
        request, which the route book learns. ``None`` when it does not answer in time: the
        known route is used."""
        task = InferenceRequest(
            request_id=request_id,
            model=deployment_id,
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
        if decision.placed:
            self.routes.set(Route.of(decision, decision.deployment_id or deployment_id))
        return decision

    async def cancel(self, deployment_id: str, request_id: str) -> None:
        message = GenerationCancel(request_id=request_id, ts=time.time())
        with contextlib.suppress(Exception):
            await self.bus.publish(CANCEL, message, deployment_id=deployment_id)

    async def _send(
        self,
        route: Route,
        request_id: str,
        prompt_token_ids: Sequence[int],
        generated: list[int],
        sampling: Sampling,
        prompt: Prompt | None = None,
    ) -> bool:
        """Send the request to the route's first shard; True once that shard took it."""
        request = GenerationRequest(
            request_id=request_id,
            deployment_id=route.deployment_id,
            epoch=route.epoch,
            prompt_token_ids=tuple(prompt_token_ids),
            # A prompt's pieces are not tokens: its re-run skips them (``delivered``).
            generated_token_ids=() if prompt is not None else tuple(generated),
            sampling=sampling,
            ts=time.time(),
            prompt=prompt,
            delivered=len(generated) if prompt is not None else 0,
        )
        # The first shard acknowledges at once. Without an answer (its worker is reconnecting
        # after a NATS restart, or gone) the stream asks again shortly; a duplicate only
        # re-runs the request, and the repeated tokens are dropped by index.
        return await self.bus.ask(
            GENERATION, request, ACK_S, deployment_id=route.deployment_id, device_id=route.first
        )
