"""Trace context crosses NATS in message headers; untraced messages stay header-free."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from libs.contracts import TELEMETRY
from libs.runtime.bus import publish, subscribe
from libs.runtime.tracing import configure_tracing
from tests.builders import make_telemetry

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracing() -> None:
    # The OpenTelemetry API takes one global provider per process: set it once here.
    configure_tracing("test", None, exporter=EXPORTER)


async def test_a_traced_publish_continues_the_trace_in_the_consumer(
    nc: NatsClient, uid: str
) -> None:
    EXPORTER.clear()
    seen: list[Any] = []
    done = asyncio.Event()

    async def handle(sample: Any, msg: Msg) -> None:
        seen.append((msg.headers, trace.get_current_span().get_span_context()))
        done.set()

    await subscribe(nc, TELEMETRY, handle, subject=TELEMETRY.subject(device_id=uid))
    await nc.flush()
    await publish(nc, TELEMETRY, make_telemetry(uid), device_id=uid)  # no trace: no headers
    await asyncio.wait_for(done.wait(), 5)
    assert seen[0][0] is None and not seen[0][1].is_valid
    done.clear()

    with trace.get_tracer("test").start_as_current_span("user request") as parent:
        await publish(nc, TELEMETRY, make_telemetry(uid), device_id=uid)
    await asyncio.wait_for(done.wait(), 5)
    headers, consumer_context = seen[1]
    assert "traceparent" in headers
    assert consumer_context.trace_id == parent.get_span_context().trace_id
    spans = {s.name: s for s in EXPORTER.get_finished_spans()}
    assert spans["send telemetry"].kind == SpanKind.PRODUCER
    assert spans["process telemetry"].kind == SpanKind.CONSUMER
    assert spans["process telemetry"].parent.span_id == spans["send telemetry"].context.span_id
    assert spans["process telemetry"].attributes["messaging.system"] == "nats"
