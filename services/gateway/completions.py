"""Chat and text completions: prompt to tokens, tokens through the placement, back as OpenAI.

The gateway owns each request: it tokenises with the model's chat template, sends the request
to the first shard of the model's deployment (``GenerationClient``), follows the deployment
when the scheduler moves it, and turns the token chunks into an OpenAI response or SSE stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from libs.contracts import DEFAULT_CONTEXT_TOKENS, DeploymentStatus, Prompt, Sampling, TokenChunk
from services.gateway.events import Ttfts
from services.gateway.generation import GenerationClient, Route, RouteBook
from services.gateway.openai_api import ApiError, new_id
from services.gateway.schedulers import ask_scheduler
from services.gateway.tokenizers import Tokenizers

log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram(
            "tessera_gateway_ttft_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tessera_gateway_inter_token_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "tessera_gateway_completion_tokens", "Completion tokens served", registry=r
        )
        self.errors = Counter(
            "tessera_gateway_generation_errors", "Generations that ended in an error", registry=r
        )
        #: The last minute's times to first token (the dashboard's latency chart).
        self.recent_ttft = Ttfts()
        self.rejected = Counter(
            "tessera_gateway_rejected_messages",
            "NATS messages that broke their contract, by channel and reason",
            ["channel", "reason"],
            registry=r,
        )

    def on_rejected(self, channel: str, reason: str, detail: str) -> None:
        self.rejected.labels(channel, reason).inc()


@dataclass
class DeployedModels:
    """What is deployed (from the scheduler) and where it runs now (``RouteBook``)."""

    routes: RouteBook
    scheduler_urls: list[str]
    models: dict[str, str] = field(default_factory=dict)  #: deployment id → model
    #: Deployments that are replicas of another (routed to by the scheduler, not listed).
    replicas: set[str] = field(default_factory=set)
    context: dict[str, int] = field(default_factory=dict)
    #: Each deployment's phase (pending, loading, serving, refused, failed) and its reason.
    phases: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    #: Called with each deployed model's name at every refresh (the gateway warms its tokenizer).
    on_model: Callable[[str], None] = lambda model: None

    async def lookup(self, model: str) -> str:
        """``resolve``, asking the scheduler again first when the model is not known yet."""
        try:
            return self.resolve(model)
        except ApiError:
            with contextlib.suppress(httpx.HTTPError):
                await self.refresh()
            return self.resolve(model)

    async def refresh(self) -> None:
        response = await ask_scheduler(self.scheduler_urls, "GET", "placements", timeout_s=5.0)
        response.raise_for_status()
        seen = set()
        for row in response.json():
            deployment = row["deployment_id"]
            seen.add(deployment)
            self.models[deployment] = row["model"]
            self.context[deployment] = int(row["context_length"])
            self.phases[deployment] = (row.get("phase", "serving"), row.get("reason"))
            if row.get("replica_of"):
                self.replicas.add(deployment)
            devices = tuple(
                a["device_id"] for a in sorted(row["assignments"], key=lambda a: a["shard_index"])
            )
            self.routes.set(Route(deployment, int(row["epoch"]), devices))
            if row.get("phase") not in ("refused", "failed"):  # nothing will be asked of it
                self.on_model(row["model"])
        for gone in set(self.models) - seen:
            self.models.pop(gone, None)
            self.phases.pop(gone, None)
            self.replicas.discard(gone)
            self.routes.forget(gone)

    def apply(self, status: DeploymentStatus) -> None:
        """A deployment's status from the scheduler (``DEPLOYMENT_STATUS``): what is deployed
        and in which phase is learned from these, the snapshot ``refresh`` only at start and
        for a model not known yet (routes: ``RouteBook.watch``)."""
        deployment = status.deployment_id
        if status.phase == "removed":
            self.models.pop(deployment, None)
            self.phases.pop(deployment, None)
            self.context.pop(deployment, None)
            self.replicas.discard(deployment)
            return
        self.models[deployment] = status.model
        self.context[deployment] = status.context_length
        self.phases[deployment] = (status.phase, status.reason)
        if status.replica_of:
            self.replicas.add(deployment)
        if status.phase == "serving":
            self.on_model(status.model)

    def phase(self, deployment: str) -> str:
        return self.phases.get(deployment, ("serving", None))[0]

    @property
    def listed(self) -> list[str]:
        """The models that serve now, by name, each once (a deployment id is an admin detail;
        a deployment pending, loading, refused or failed serves nothing)."""
        return sorted({m for d, m in self.models.items() if self.phase(d) == "serving"})

    def resolve(self, model: str) -> str:
        """The deployment serving ``model`` (by deployment id, then by model name; one that
        serves before one still loading). A refused or failed one is named with its reason."""
        final = ("refused", "failed")
        if model in self.models and self.routes.get(model) and self.phase(model) not in final:
            return model
        named = [d for d, name in sorted(self.models.items()) if name == model]
        usable = [d for d in named if self.routes.get(d) is not None]
        for deployment in sorted(usable, key=lambda d: self.phase(d) != "serving"):
            if self.phase(deployment) not in final:
                return deployment
        for deployment in [model, *named]:
            phase, reason = self.phases.get(deployment, ("", None))
            if phase in final:
                message = f"model {model!r} is not served: {deployment} {phase}: {reason}"
                raise ApiError(404, message, code="model_not_found")
        known = ", ".join(self.listed) or "none"
        raise ApiError(
            404, f"model {model!r} is not deployed (serving: {known})", code="model_not_found"
        )


class Slot:
    """One admitted request's place under the concurrency limit, given back exactly once."""

    def __init__(self, owner: Completions) -> None:
        self.owner, self.held = owner, True
        owner.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.owner.in_flight -= 1


class Completions:
    def __init__(
        self,
        client: GenerationClient,
        deployments: DeployedModels,
        tokenizers: Tokenizers,
        metrics: GatewayMetrics,
        max_concurrent: int,
    ) -> None:
        self.client = client
        self.deployments = deployments
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.max_concurrent = max_concurrent
        self.in_flight = 0

    async def tokenizer(self, deployment: str) -> Any:
        return await self.tokenizers.get(self.deployments.models[deployment])

    def check(self, deployment: str, prompt_tokens: int, max_tokens: int) -> None:
        context = self.deployments.context.get(deployment, DEFAULT_CONTEXT_TOKENS)
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
        return Slot(self)

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
        last: float | None = None
        counted = 0
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
                        self.metrics.ttft.observe(now - started)
                        self.metrics.recent_ttft.add(now - started)
                    else:
                        self.metrics.inter_token.observe(now - last)
                    last = now
                if chunk.finish_reason == "error":
                    self.metrics.errors.inc()
                elif chunk.finished and not counted:  # a prompt's pieces: counted at the end
                    self.metrics.tokens.inc(chunk.completion_tokens or 0)
                yield chunk
        finally:
            if slot is not None:
                slot.release()
