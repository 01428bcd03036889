"""Flood a running cluster's NATS consumers with malformed messages (``bench/fuzz.py``, tests).

Every channel some service consumes gets its share of ``count`` malformed payloads
(``libs/contracts/malformed.py``), addressed to the device and deployment under test; the work
channel goes through JetStream as the scheduler sends it; hidden-state subjects get broken
binary frames. Returns what was sent, by channel and kind, for the caller to compare with the
rejections each service counted.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import httpx
from nats.aio.client import Client as NatsClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from libs.contracts import HIDDEN, SHARD_TASK, Channel, Frame, FrameKind
from libs.contracts.malformed import malformed, malformed_frame
from libs.runtime.nats_client import ensure_streams

Sample = tuple[Channel[BaseModel], BaseModel, dict[str, str]]


async def flood(
    nc: NatsClient,
    samples: Sequence[Sample],
    count: int,
    *,
    seed: int = 0,
    device_id: str,
    deployment_id: str,
    flush_every: int = 500,
) -> dict[str, collections.Counter[str]]:
    """Send ``count`` malformed messages round-robin over ``samples``' channels and hidden
    frames; returns channel name → kind → number sent."""
    rng = random.Random(seed)
    await ensure_streams(nc)
    js = nc.jetstream()
    fill = {"device_id": device_id, "deployment_id": deployment_id}
    targets = []
    for channel, message, tokens in samples:
        subject = channel.subject(**{k: fill.get(k, v) for k, v in tokens.items()})
        targets.append((channel, subject, channel.encode(message)))
    frame = Frame(FrameKind.PREFILL, "req-1", 1, dtype="float32", shape=(1, 4), data=b"\0" * 16)
    hidden = HIDDEN.subject(deployment_id=deployment_id, device_id=device_id, sender_id=device_id)
    sent: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for i in range(count):
        slot = i % (len(targets) + 1)
        if slot == len(targets):
            kind, payload = malformed_frame(frame.encode(), rng)
            await nc.publish(hidden, payload)
            sent[HIDDEN.name][kind] += 1
        else:
            channel, subject, valid = targets[slot]
            kind, payload = malformed(channel.model, valid, rng)
            if channel is SHARD_TASK:
                await js.publish(subject, payload)
            else:
                await nc.publish(subject, payload)
            sent[channel.name][kind] += 1
        if (i + 1) % flush_every == 0:
            await nc.flush()
    await nc.flush()
    return sent


#: Which service counts the rejections of which channels: its /metrics target name in the
#: run file, the counter, and the channels (the scheduler counts by reason ``bad_message:…``).
COUNTED = {
    "scorer": ("tessera_telemetry_rejected", ("announce", "telemetry", "mode_change")),
    "worker-0": (
        "tessera_worker_rejected_messages",
        ("generation", "cancel", "hidden", "shard_task"),
    ),
    "gateway": (
        "tessera_gateway_rejected_messages",
        (
            "placement_decision",
            "device_failed",
            "device_recovered",
            "score",
            "mode_change",
            "deployment_event",
            "deployments_snapshot",
            "service_restart",
        ),
    ),
    "scheduler": (
        "tessera_scheduler_rejections",
        (
            "placement_request",
            "score",
            "device_failed",
            "device_recovered",
            "shard_status",
            "deployment_measured",
        ),
    ),
}


def rejections(target: str, metric: str) -> dict[str, float]:
    """A rejection counter's totals by channel (the scheduler's: all under "bad_message"),
    scraped from ``target``'s /metrics."""
    text = httpx.get(f"http://{target}/metrics", timeout=5).text
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != f"{metric}_total":
                continue
            reason = sample.labels.get("reason", "")
            if "channel" in sample.labels:
                totals[sample.labels["channel"]] += sample.value
            elif reason.startswith("bad_message:"):
                totals["bad_message"] += sample.value
    return totals


def tally(
    sent: dict[str, collections.Counter[str]], targets: dict[str, str]
) -> dict[str, dict[str, tuple[float, float]]]:
    """Service → channel → (sent, counted as rejected) for every counting service."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for service, (metric, channels) in COUNTED.items():
        got = rejections(targets[service], metric)
        wanted = {c: float(sum(sent[c].values())) for c in channels}
        if service == "scheduler":
            wanted = {"bad_message": sum(wanted.values())}
        out[service] = {c: (n, got.get(c, 0.0)) for c, n in wanted.items()}
    return out
