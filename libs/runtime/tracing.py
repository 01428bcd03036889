"""OpenTelemetry set-up, and trace context carried in NATS message headers (W3C traceparent).

``configure_tracing`` installs the SDK with an OTLP/HTTP exporter when an endpoint is set
(``TESSERA_OTLP_ENDPOINT``, e.g. http://otel-collector:4318), prints spans with ``console``,
writes them as JSON lines under a folder with ``file:///folder`` (one file per process: what
the one-trace test reads), and leaves tracing off otherwise (the API's no-op tracer: nothing
is recorded or sent).
Propagation uses OpenTelemetry's own W3C propagator (``opentelemetry.propagate``); spans follow
the messaging semantic conventions (messaging.system, destination, operation).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind

TRACER_NAME = "tessera"
TRACEPARENT = "traceparent"


def configure_tracing(
    service: str, endpoint: str | None, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install the SDK for ``service``; returns the provider, or None when tracing is off."""
    if exporter is None and not endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"tessera-{service}"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif endpoint == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif str(endpoint).startswith("file://"):
        folder = Path(str(endpoint).removeprefix("file://"))
        folder.mkdir(parents=True, exist_ok=True)
        out = (folder / f"{service}-{os.getpid()}.jsonl").open("a", encoding="utf-8")
        lines = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(lines))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = str(endpoint).rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    trace.set_tracer_provider(provider)
    return provider


def instrument(provider: TracerProvider | None, app: object | None = None) -> None:
    """Instrument Redis calls (and a FastAPI app) with the kept OpenTelemetry
    instrumentations, only when tracing is on."""
    if provider is None:
        return
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    RedisInstrumentor().instrument(tracer_provider=provider)
    if app is not None:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)  # type: ignore[arg-type]


def instrument_celery(provider: TracerProvider | None) -> None:
    """Carry trace context through Celery (publish and run spans), only when tracing is on."""
    if provider is None:
        return
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]


def _attributes(subject: str, operation: str) -> dict[str, str]:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
    }


@contextmanager
def sending(channel_name: str, subject: str) -> Iterator[dict[str, str] | None]:
    """A producer span around a publish; yields the headers that carry its context (None when
    nothing is being traced, so untraced messages stay header-free)."""
    if not trace.get_current_span().get_span_context().is_valid:
        yield None
        return
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"send {channel_name}", kind=SpanKind.PRODUCER, attributes=_attributes(subject, "send")
    ):
        headers: dict[str, str] = {}
        propagate.inject(headers)
        yield headers


@contextmanager
def processing(
    channel_name: str, subject: str, headers: Mapping[str, str] | None
) -> Iterator[Span | None]:
    """A consumer span, child of the context the message carries; none if it carries none."""
    if not headers or TRACEPARENT not in headers:
        yield None
        return
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"process {channel_name}",
        context=propagate.extract(dict(headers)),
        kind=SpanKind.CONSUMER,
        attributes=_attributes(subject, "process"),
    ) as span:
        yield span


def carried() -> dict[str, str] | None:
    """The current trace context as message headers (None when nothing is traced)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


@contextmanager
def step(name: str, headers: Mapping[str, str] | None, **attributes: str | int) -> Iterator[None]:
    """A span for work done on a message's behalf later (a shard's step), child of the context
    the message carried; nothing when it carried none."""
    if not headers or TRACEPARENT not in headers:
        yield
        return
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, context=propagate.extract(dict(headers))) as span:
        span.set_attributes(attributes)
        yield
