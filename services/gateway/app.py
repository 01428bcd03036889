"""The gateway's FastAPI application, wired: OpenAI's, Anthropic's and Ollama's APIs over the
request core, the admin API and dashboard, health and metrics.

Connections are opened in the lifespan and kept on ``app.state``; handlers read them from
there, so nothing is created at import time. Every error leaves in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from libs.contracts import DEPLOYMENT_MEASURED, DeploymentMeasured
from libs.contracts.keys import Keys
from libs.deployments import other_groups
from libs.runtime.bus import NatsBus
from libs.runtime.lifecycle import Background
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.redis_client import connect_redis
from services.gateway.admin.dashboard import dashboard_router
from services.gateway.admin.events import EventHub
from services.gateway.admin.router import admin_router
from services.gateway.anthropic.router import anthropic_router
from services.gateway.batches.anthropic_routes import message_batches_router
from services.gateway.batches.preempt import BatchRequests, Preemptible
from services.gateway.batches.routes import batches_router
from services.gateway.batches.runner import BatchRunner
from services.gateway.batches.sender import AsgiSender, CelerySender
from services.gateway.batches.store import JobStore
from services.gateway.core.completions import Completions
from services.gateway.core.deployed import Deployed
from services.gateway.core.error_shapes import ErrorShapes
from services.gateway.core.generation import GenerationClient
from services.gateway.core.guards import install_errors, install_limits
from services.gateway.core.metrics import GatewayMetrics, RequestMetrics
from services.gateway.core.schedulers import split_urls
from services.gateway.core.speeds import SEND_EVERY_S, Speeds
from services.gateway.core.tokenizers import Tokenizers
from services.gateway.ollama.model_router import ollama_models_router
from services.gateway.ollama.router import ollama_router
from services.gateway.openai.router import openai_router
from services.gateway.settings import GatewaySettings


def create_app(settings: GatewaySettings) -> FastAPI:
    registry = CollectorRegistry()

    deployments = Deployed(split_urls(settings.scheduler_url))
    # The batch runner's key: the batch workers' too when they send its requests.
    runner_key = settings.batch_runner_key.get_secret_value() or secrets.token_urlsafe(32)
    batch_requests = BatchRequests(runner_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def reconnected() -> None:
            deployments.resend_all()  # tokens in flight during the outage are gone: ask again

        nc = await connect_nats(
            settings.nats_url, "gateway", reconnected=reconnected, ca_file=settings.nats_ca
        )
        app.state.nats = nc
        app.state.redis = connect_redis(settings.redis_url)
        await app.state.redis.ping()
        metrics = GatewayMetrics(registry)
        bus = NatsBus(nc)
        watch = await deployments.watch(bus, metrics.on_rejected)
        hub = EventHub(
            app.state.redis,
            Keys(settings.key_prefix),
            metrics.recent_ttft,
            on_restart=metrics.on_restart,
        )
        deployments.follower.on_change(hub.on_deployments)
        watch += await hub.watch(bus, metrics.on_rejected)
        await nc.flush()  # the server holds our subscriptions before the app serves
        app.state.events = hub
        client = GenerationClient(
            bus, deployments, stall_s=settings.stall_s, rejected=metrics.on_rejected
        )
        tokenizers = Tokenizers()
        deployments.on_model = tokenizers.warm  # loaded in a thread as soon as deployed
        speeds = Speeds()
        app.state.completions = Completions(
            client, deployments, tokenizers, metrics, settings.max_concurrent, speeds
        )
        background = Background("gateway")

        async def tell(news: DeploymentMeasured) -> None:  # the scheduler, and the metrics
            await bus.publish(DEPLOYMENT_MEASURED, news, deployment_id=news.deployment_id)
            state = deployments.book.get(news.deployment_id)
            predicted = None if state is None else state.predicted
            metrics.on_speed(
                news.deployment_id, {"predicted": predicted, "measured": news.measured}
            )

        background.every(
            SEND_EVERY_S,
            lambda: speeds.send(tell, [d.deployment_id for d in deployments.book.live()]),
        )

        # What is deployed now, once (tried again every 2 s until the scheduler answers);
        # from here on each change arrives as a deployment event.
        async def until_snapshot() -> None:
            while not await deployments.catch_up():
                await asyncio.sleep(2.0)

        if not await deployments.catch_up():
            background.tasks.append(asyncio.create_task(until_snapshot()))
        background.every(hub.stats_every_s, hub.stats)
        # Batches: each request through this app, at most half the requests in flight (edge
        # deployments' with the cloud's), yielding to interactive ones (told of each as it is
        # admitted).
        concurrency = min(settings.batch_concurrency, max(1, settings.max_concurrent // 2))
        broker = settings.batch_broker_url.get_secret_value()
        send: AsgiSender | CelerySender = (
            CelerySender(broker, settings.key_prefix, batch_requests.preempt)
            if broker
            else AsgiSender(app, runner_key)
        )
        store = JobStore(app.state.redis, settings.key_prefix)
        completions = app.state.completions
        app.state.batches = BatchRunner(
            store,
            send,
            concurrency,
            lambda: completions.interactive,
            settings.batch_policy,
            lambda model: other_groups(model, deployments.book),
            max(concurrency, settings.max_concurrent // 2),
        )
        runner = app.state.batches
        completions.on_admit = runner.wake.set
        metrics.watch_batches(
            {
                "preempted": lambda: runner.preempted,
                "worker_lost": lambda: send.lost,
                "not_taken": lambda: send.resent,
            }
        )
        background.tasks.append(asyncio.create_task(app.state.batches.run()))
        try:
            yield
        finally:
            await background.close()
            await app.state.batches.close()
            await send.aclose()
            await tokenizers.close()
            await deployments.close()
            for sub in watch:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await close_nats(nc)
            await app.state.redis.aclose()

    app = FastAPI(
        title="Tessera gateway",
        version="0.1.0",
        description="OpenAI-compatible API of a Tessera cluster (and Anthropic's Messages and "
        "Ollama's API on the same models), and its admin API.",
        lifespan=lifespan,
    )
    app.state.registry = registry
    app.state.deployments = deployments
    app.state.key_prefix = settings.key_prefix  # the model registry's keys
    install_errors(app)
    app.add_middleware(Preemptible, requests=batch_requests)  # inside the key checks
    install_limits(app, settings, registry, runner_key)
    app.include_router(openai_router(settings))
    app.include_router(batches_router(settings))
    app.include_router(message_batches_router(settings))
    app.include_router(anthropic_router())
    app.include_router(ollama_router())
    app.include_router(ollama_models_router())
    app.include_router(admin_router(settings))
    app.include_router(dashboard_router())
    requests_total = Counter(
        "tessera_gateway_requests",
        "HTTP requests by route and status",
        ["route", "status"],
        registry=registry,
    )
    duration = Histogram(
        "tessera_gateway_request_duration_seconds",
        "HTTP request duration, to the response's last byte (a stream's end)",
        ["route"],
        registry=registry,
    )
    app.add_middleware(RequestMetrics, requests=requests_total, duration=duration)
    app.add_middleware(ErrorShapes)  # outermost: every error, in its API's shape

    @app.get("/healthz", summary="Liveness and dependency health")
    async def healthz(request: Request) -> JSONResponse:
        nats_ok = request.app.state.nats.is_connected
        try:
            redis_ok = bool(await request.app.state.redis.ping())
        except Exception:
            redis_ok = False
        ok = nats_ok and redis_ok
        body = {"status": "ok" if ok else "degraded", "nats": nats_ok, "redis": redis_ok}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
