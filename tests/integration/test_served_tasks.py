"""A served worker's shard tasks while its engine starts: the real ``ServedWorker`` (as the
``VllmWorker`` kind, which takes any one-shard task) on a real nats-server, its engine a real
process that answers its health check only once the test opens a gate (a start as slow as the
test wants: vLLM's takes minutes, llama.cpp's seconds). An unload or a newer task is taken
during the start, not after it, and a start longer than the consumer's ack wait keeps its task
(nothing is delivered again mid-start). Several deployments on one worker (``ServedWorker``
with hooks that take any task): a server each, an unload stops only its own, and a model the
device's memory cannot take beside the others is refused naming them; vLLM's worker takes one
model at a time, saying so."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js.api import ConsumerInfo

from libs.cluster.servers import NatsServer
from libs.contracts import (
    SHARD_STATUS,
    SHARD_TASK,
    STREAMS,
    DeviceClass,
    ModelCard,
    Sampling,
    ShardStatus,
    ShardTask,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.models.shipped import shipped_card
from libs.runtime.acks import Redelivery
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import close_nats, connect_nats, ensure_streams
from services.worker.device.processes import engine_env
from services.worker.served.server import EngineServer, Piece
from services.worker.served.vllm_worker import VllmWorker
from services.worker.served.worker import MEMORY_SHARE, ServedWorker
from tests.waiting import wait_until, wait_until_async

QUICK = Redelivery(ack_wait_s=1.0, max_deliver=3, retry_delay_s=0.05)
STREAM = next(name for name, subjects in STREAMS.items() if SHARD_TASK.wildcard in subjects)
#: An HTTP server whose health check answers 200 only once the gate file exists.
GATED = """
import http.server, os, sys
port, gate = int(sys.argv[1]), sys.argv[2]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if os.path.exists(gate) else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class GatedEngine(EngineServer):
    """An engine server process that starts when the test says (its gate file appears)."""

    engine = "gated"

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = gate

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", GATED, str(self.port), str(self.gate)], engine_env()

    def check(self) -> None:
        return None

    async def prepare(self) -> None:
        return None

    async def release(self) -> None:
        return None

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int
    ) -> AsyncIterator[Piece]:
        yield Piece((7,), "x", "stop")


class Started:
    """What the worker started: the task and engine of each start, in order."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate
        self.starts: list[tuple[ShardTask, GatedEngine]] = []

    def __call__(self, task: ShardTask) -> EngineServer:
        engine = GatedEngine(self.gate)
        self.starts.append((task, engine))
        return engine


@pytest.fixture
async def nats_bus(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    nc = await connect_nats(nats_server.url, "served")
    await ensure_streams(nc)
    yield NatsBus(nc)
    await close_nats(nc)


@dataclass
class Rig:
    """A served worker on the bus, what it started, and the final statuses it sent."""

    bus: NatsBus
    served: VllmWorker
    started: Started
    got: list[ShardStatus]

    async def send(
        self, action: Any, epoch: int, deployment: str = "dep", card: ModelCard | None = None
    ) -> None:
        device_id = self.served.device_id
        model = card.name if card else "smollm2-135m-instruct"
        layers = card.layers if card else 30
        shards = [(device_id, 0, layers)]
        [one] = shard_ring(action, deployment, model, shards, epoch, 0, card=card)
        await self.bus.publish_durable(SHARD_TASK, one, device_id=device_id)

    async def running(self, count: int) -> GatedEngine:
        """Wait until the ``count``-th engine's process runs; that engine."""
        starts = self.started.starts
        await wait_until(lambda: len(starts) >= count and starts[count - 1][1].proc, 10)
        return starts[count - 1][1]

    async def consumer(self) -> ConsumerInfo:
        js = self.bus.nc.jetstream()
        info: ConsumerInfo = await js.consumer_info(STREAM, f"worker-{self.served.device_id}")
        return info

    async def settled(self) -> None:
        """Wait until every task the worker got is acknowledged (none can come again)."""

        async def nothing_pending() -> bool:
            return (await self.consumer()).num_ack_pending == 0

        await wait_until_async(nothing_pending, timeout_s=10)


class AnyWorker(ServedWorker):
    """A served worker whose engine kind takes any task (no layers lent, nothing to fetch):
    ``ServedWorker``'s own rules alone."""

    def refusal(self, task: ShardTask) -> str | None:
        return None

    def same_server(self, current: ShardTask, task: ShardTask) -> bool:
        return True

    async def hold_weights(self, task: ShardTask) -> None:
        return None

    async def on_lent_task(self, task: ShardTask) -> bool:
        return False

    async def open_engine(self) -> None:
        return None

    async def close_engine(self) -> None:
        await self.stop_serving()

    async def tick(self) -> None:
        return None

    async def preload(self) -> None:
        return None


@pytest.fixture(params=[VllmWorker])
async def rig(
    request: pytest.FixtureRequest, nats_bus: NatsBus, uid: str, tmp_path: Path
) -> AsyncIterator[Rig]:
    device = EmulatedDevice.draw(uid, DeviceClass.WORKSTATION, np.random.default_rng(0))
    started = Started(tmp_path / "gate")
    served = request.param(nats_bus, device, started, start_s=600.0)
    served.redelivery = QUICK
    got: list[ShardStatus] = []

    async def on_status(status: ShardStatus, delivery: Any) -> None:
        if status.state != "loading":
            got.append(status)

    sub = await nats_bus.subscribe(
        SHARD_STATUS, on_status, subject=SHARD_STATUS.subject(device_id=uid)
    )
    await served.start()
    yield Rig(nats_bus, served, started, got)
    await served.close()
    await sub.unsubscribe()


async def test_an_unload_sent_during_a_slow_start_is_taken_at_once(rig: Rig) -> None:
    await rig.send("load", 1)
    proc = (await rig.running(1)).proc
    assert proc is not None
    # The gate stays shut: a start that is waited for would end only after start_s (600 s).
    await rig.send("unload", 1)
    await wait_until(lambda: rig.got, timeout_s=15)
    assert [(s.state, s.epoch) for s in rig.got] == [("unloaded", 1)]
    assert proc.returncode is not None  # the engine's start was stopped
    assert not rig.served.hosted
    assert not rig.served.device.work
    await rig.settled()  # both tasks acknowledged: neither comes again


async def test_a_start_longer_than_the_ack_wait_keeps_its_task_and_a_newer_one_supersedes_it(
    rig: Rig,
) -> None:
    await rig.send("load", 1)
    first = await rig.running(1)
    await asyncio.sleep(2.5 * QUICK.ack_wait_s)  # the start outlasts the ack wait
    await rig.send("load", 2)
    await rig.running(2)
    rig.started.gate.touch()
    await wait_until(lambda: rig.got, timeout_s=15)
    assert [(s.state, s.epoch) for s in rig.got] == [("loaded", 2)]  # epoch 1: superseded
    assert [t.epoch for t, _ in rig.started.starts] == [1, 2]
    assert first.proc is None  # stopped when epoch 2 came
    await rig.settled()
    assert (await rig.consumer()).num_redelivered == 0  # the long start's task never came again
    hosted = rig.served.hosted["dep"]
    assert hosted.ready.is_set() and hosted.task.epoch == 2


def sized(name: str, gb: float) -> ModelCard:
    """The shipped model's card under ``name``, its layers scaled to hold about ``gb``."""
    card = shipped_card()
    scale = gb * 1e9 / max(1, sum(card.layer_bytes))
    layer_bytes = tuple(int(b * scale) for b in card.layer_bytes)
    return card.model_copy(update={"name": name, "layer_bytes": layer_bytes})


@pytest.mark.parametrize("rig", [AnyWorker], indirect=True)
async def test_each_deployment_has_its_own_server_and_an_unload_stops_only_its_own(
    rig: Rig,
) -> None:
    limit = rig.served.device.memory_limit_gb * MEMORY_SHARE
    a, b, c = sized("model-a", 0.3 * limit), sized("model-b", 0.3 * limit), sized("c", 0.5 * limit)
    rig.started.gate.touch()
    await rig.send("load", 1, "dep-a", a)
    await rig.send("load", 1, "dep-b", b)
    await wait_until(lambda: len(rig.got) == 2, timeout_s=15)
    assert sorted((s.deployment_id, s.state) for s in rig.got) == [
        ("dep-a", "loaded"),
        ("dep-b", "loaded"),
    ]
    first, second = (await rig.running(1)), (await rig.running(2))
    assert first.proc is not None and second.proc is not None  # a server each, both up
    assert set(rig.served.hosted) == {"dep-a", "dep-b"}

    # A third the memory cannot take beside them: refused, naming what the device holds.
    await rig.send("load", 1, "dep-c", c)
    await wait_until(lambda: len(rig.got) == 3, timeout_s=15)
    refused = rig.got[2]
    assert (refused.deployment_id, refused.state) == ("dep-c", "refused")
    assert "memory cannot take dep-c" in (refused.reason or "") and "dep-a, dep-b" in (
        refused.reason or ""
    )

    by_deployment = {t.deployment_id: engine for t, engine in rig.started.starts}
    await rig.send("unload", 1, "dep-a")
    await wait_until(lambda: len(rig.got) == 4, timeout_s=15)
    assert (rig.got[3].deployment_id, rig.got[3].state) == ("dep-a", "unloaded")
    assert by_deployment["dep-a"].proc is None  # stopped
    assert by_deployment["dep-b"].proc is not None  # the other serves on
    assert set(rig.served.hosted) == {"dep-b"} and rig.served.hosted["dep-b"].ready.is_set()

    await rig.send("load", 2, "dep-c", c)  # room now that dep-a is gone
    await wait_until(lambda: len(rig.got) == 5, timeout_s=15)
    assert (rig.got[4].deployment_id, rig.got[4].state) == ("dep-c", "loaded")
    await rig.settled()


def folder_card(name: str, folder: Path, gb: float = 0.1) -> ModelCard:
    """A Hugging Face folder's card (a llama, which vLLM's build registers) lying at ``folder``."""
    update = {"format": "hf", "source": str(folder), "architecture": "LlamaForCausalLM"}
    return sized(name, gb).model_copy(update=update)


async def test_a_vllm_worker_runs_models_side_by_side_as_its_memory_holds(
    rig: Rig, tmp_path: Path
) -> None:
    """A server per deployment, as Ollama and GPUStack run them: a second model beside the
    first; refused only what its memory cannot take beside them, or a folder on another host."""
    rig.started.gate.touch()
    await rig.send("load", 1, "dep-a", folder_card("model-a", tmp_path))
    await wait_until(lambda: rig.got, timeout_s=15)
    await rig.send("load", 1, "dep-b", folder_card("model-b", tmp_path))
    await wait_until(lambda: len(rig.got) == 2, timeout_s=15)
    assert [(s.deployment_id, s.state) for s in rig.got] == [
        ("dep-a", "loaded"),
        ("dep-b", "loaded"),
    ]
    assert set(rig.served.hosted) == {"dep-a", "dep-b"}
    big = folder_card("model-c", tmp_path, rig.served.device.memory_limit_gb * MEMORY_SHARE)
    await rig.send("load", 1, "dep-c", big)
    await wait_until(lambda: len(rig.got) == 3, timeout_s=15)
    assert rig.got[2].state == "refused"
    assert "memory cannot take dep-c" in (rig.got[2].reason or "")
    elsewhere = folder_card("model-d", tmp_path / "on-another-host")  # not on this host
    await rig.send("load", 1, "dep-d", elsewhere)
    await wait_until(lambda: len(rig.got) == 4, timeout_s=15)
    assert rig.got[3].state == "refused"
    assert "a Hugging Face folder is served on the host it lies on" in (rig.got[3].reason or "")
    await rig.settled()
