"""How the gateway learns what serves and where, on a real NATS server: from the scheduler's
deployment events, never from the broadcast of every decision, and with no polling; an event
lost on the way is made good by the next snapshot."""

from __future__ import annotations

import time

from nats.aio.client import Client as NatsClient

from libs.contracts import (
    DEPLOYMENT_EVENT,
    DEPLOYMENTS_SNAPSHOT,
    PLACEMENT_DECISION,
    Assignment,
    DeploymentChange,
    DeploymentPlanned,
    DeploymentRemoved,
    DeploymentState,
    Mode,
    PlacementDecision,
    ShardProgress,
    ShardReported,
)
from libs.deployments import DeploymentBook, phases, record
from libs.runtime.bus import NatsBus
from services.gateway.core.deployed import Deployed, Route
from tests.waiting import wait_until

MODEL = "smollm2-135m-instruct"


def plan(deployment: str, epoch: int, device: str) -> DeploymentPlanned:
    state = DeploymentState(
        deployment_id=deployment,
        model=MODEL,
        epoch=epoch,
        context_length=4096,
        assignments=(Assignment(device_id=device, layer_end=30),),
    )
    return DeploymentPlanned(deployment=phases.planned(state, ()))


def loaded(deployment: str, epoch: int, device: str) -> ShardReported:
    shard = ShardProgress(device_id=device, shard_index=0, state="loaded", progress=1.0)
    return ShardReported(deployment_id=deployment, epoch=epoch, shard=shard)


class Writer:
    """The scheduler's side: numbered events on NATS, and snapshots when asked."""

    def __init__(self, bus: NatsBus) -> None:
        self.bus, self.book = bus, DeploymentBook(term="t1")

    async def snapshot(self) -> None:
        await self.bus.publish(DEPLOYMENTS_SNAPSHOT, self.book.snapshot(time.time()))

    async def change(self, change: DeploymentChange, lose: bool = False) -> None:
        self.book, [event] = record(self.book, [change], time.time())
        if not lose:
            await self.bus.publish(DEPLOYMENT_EVENT, event, deployment_id="d")


async def test_the_gateway_follows_the_deployment_book_and_not_the_decision_broadcast(
    nc: NatsClient, uid: str
) -> None:
    bus = NatsBus(nc)
    view = Deployed()  # no scheduler URL: nothing is polled
    await view.watch(bus)
    await nc.flush()
    writer, name = Writer(bus), f"{uid}d"
    await writer.snapshot()
    await writer.change(plan(name, 1, "dev-a"))
    await wait_until(lambda: name in view.book, 5)
    assert view.listed == [] and view.route(name) is None  # pending: not listed, no route
    await writer.change(loaded(name, 1, "dev-a"))
    await wait_until(lambda: view.route(name) is not None, 5)
    assert view.listed == [MODEL] and view.context_of(name) == 4096  # listed by its model
    assert view.route(name) == Route(name, 1, ("dev-a",))
    # A decision broadcast (a plan not loaded yet) moves nothing.
    broadcast = PlacementDecision(
        task_id=name,
        kind="deployment",
        placed=True,
        assignments=(Assignment(device_id="dev-b"),),
        policy="partition",
        mode=Mode.BALANCED,
        epoch=2,
        ts=time.time(),
        deployment_id=name,
    )
    await bus.publish(PLACEMENT_DECISION, broadcast, task_id=name)
    other = f"{uid}e"  # published after it on the same connection: seen after it
    await writer.change(plan(other, 1, "dev-e"))
    await wait_until(lambda: other in view.book, 5)
    assert view.route(name) == Route(name, 1, ("dev-a",))
    # The new plan serving moves it; removal forgets it.
    await writer.change(plan(name, 3, "dev-c"))
    await writer.change(loaded(name, 3, "dev-c"))
    await wait_until(lambda: view.route(name) == Route(name, 3, ("dev-c",)), 5)
    await writer.change(DeploymentRemoved(deployment_id=name))
    await wait_until(lambda: name not in view.book, 5)
    assert view.listed == [] and view.route(name) is None


async def test_an_event_lost_on_the_way_is_made_good_by_the_next_snapshot(
    nc: NatsClient, uid: str
) -> None:
    bus = NatsBus(nc)
    view = Deployed()
    await view.watch(bus)
    await nc.flush()
    writer, name = Writer(bus), f"{uid}d"
    await writer.snapshot()
    await writer.change(plan(name, 1, "dev-a"))
    await writer.change(loaded(name, 1, "dev-a"), lose=True)  # never arrives
    await writer.change(plan(f"{uid}e", 1, "dev-e"))  # arrives, but one is missing before it
    await nc.flush()
    await wait_until(lambda: name in view.book, 5)
    assert view.route(name) is None and f"{uid}e" not in view.book  # held back, not guessed
    await writer.snapshot()  # the scheduler's periodic one
    await wait_until(lambda: view.route(name) == Route(name, 1, ("dev-a",)), 5)
    assert view.book.index == writer.book.index and f"{uid}e" in view.book
