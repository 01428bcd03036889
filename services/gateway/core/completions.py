"""The request core every API's request runs through: the model's tokenizer and context
check, the concurrency limit, and the generation's chunks, measured.

The gateway owns each request: it tokenises with the model's chat template, sends the request
to the first shard of the model's deployment (``GenerationClient``), follows the deployment
when the scheduler moves it, and each API turns the chunks into its response or stream
(``answers`` gathers them for it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from libs.contracts import Prompt, Sampling, TokenChunk
from services.gateway.core.deployed import Deployed
from services.gateway.core.errors import ApiError
from services.gateway.core.generation import GenerationClient
from services.gateway.core.ids import new_id
from services.gateway.core.metrics import GatewayMetrics
from services.gateway.core.speeds import Speeds
from services.gateway.core.tokenizers import Tokenizers

#: True while the batch runner's request is handled (``batches/preempt.py`` sets it).
BATCH_REQUEST: ContextVar[bool] = ContextVar("batch_request", default=False)


class Slot:
    """One admitted request's place under the concurrency limit, given back exactly once."""

    def __init__(self, owner: Completions) -> None:
        self.owner, self.held, self.batch = owner, True, BATCH_REQUEST.get()
        owner.in_flight += 1
        owner.batch_in_flight += self.batch

    def release(self) -> None:
        if self.held:
            self.held = False
            self.owner.in_flight -= 1
            self.owner.batch_in_flight -= self.batch


class Completions:
    def __init__(
        self,
        client: GenerationClient,
        deployments: Deployed,
        tokenizers: Tokenizers,
        metrics: GatewayMetrics,
        max_concurrent: int,
        speeds: Speeds | None = None,
    ) -> None:
        self.client = client
        self.deployments = deployments
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.max_concurrent = max_concurrent
        #: Requests admitted now, and the batch runner's among them.
        self.in_flight = self.batch_in_flight = 0
        #: What each deployment's requests measured (sent to the scheduler).
        self.speeds = speeds or Speeds()
        #: Told of every interactive request admitted (the batch runner yields to them).
        self.on_admit: Callable[[], None] = lambda: None

    @property
    def interactive(self) -> int:
        """Requests admitted now that are not the batch runner's."""
        return self.in_flight - self.batch_in_flight

    async def tokenizer(self, deployment: str) -> Any:
        return await self.tokenizers.get(self.deployments.model_of(deployment))

    def check(self, deployment: str, prompt_tokens: int, max_tokens: int) -> None:
        context = self.deployments.context_of(deployment)
        if prompt_tokens + max_tokens > context:
            raise ApiError(
                400,
                f"{prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed the context "
                f"length {context}",
                code="context_length_exceeded",
                param="messages",
            )

    def admit(self) -> Slot:
        """Count the request as in flight now, before anything is awaited or answered, so a
        burst cannot pass the limit; 429 past it."""
        if self.in_flight >= self.max_concurrent:
            raise ApiError(
                429,
                f"{self.in_flight} requests in flight (limit {self.max_concurrent}); retry shortly",
                "rate_limit_error",
                "overloaded",
                headers={"Retry-After": "1"},
            )
        slot = Slot(self)
        if not slot.batch:
            self.on_admit()
        return slot

    async def chunks(
        self,
        deployment: str,
        prompt_ids: list[int],
        sampling: Sampling,
        slot: Slot | None,
        prompt: Prompt | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """The request's chunks (tokens, or a ``prompt``'s pieces), measured; ``slot``, if
        given, is given back when they end."""
        started = time.perf_counter()
        first: float | None = None
        last: float | None = None
        counted = pieces = 0
        run = self.speeds.began(deployment, self._epoch(deployment))
        try:
            async for chunk in self.client.stream(
                deployment, new_id("gen")[4:40], prompt_ids, sampling, prompt
            ):
                now = time.perf_counter()
                if chunk.token_id is not None or (prompt is not None and not chunk.finished):
                    if chunk.token_id is not None:
                        self.metrics.tokens.inc()
                        counted += 1
                    if last is None:
                        first = now
                        self.metrics.ttft.observe(now - started)
                        self.metrics.recent_ttft.add(now - started)
                    else:
                        self.metrics.inter_token.observe(now - last)
                    last = now
                if chunk.finish_reason == "error":
                    self.metrics.errors.inc()
                elif chunk.finished and not counted:  # a prompt's pieces: counted at the end
                    pieces = chunk.completion_tokens or 0
                    self.metrics.tokens.inc(pieces)
                yield chunk
        finally:
            if slot is not None:
                slot.release()
            tokens = counted or pieces
            self.speeds.ended(run, tokens, first, last, started, self._epoch(deployment))

    def _epoch(self, deployment: str) -> int | None:
        """The plan ``deployment`` runs under now (None: not in the book)."""
        state = self.deployments.book.get(deployment)
        return None if state is None else state.epoch
