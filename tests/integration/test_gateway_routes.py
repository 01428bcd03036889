"""How the gateway learns what serves and where, on a real NATS server: from the scheduler's
deployment status (and the answer to each request's placement), never from the broadcast of
every decision, and with no polling."""

from __future__ import annotations

import time

from nats.aio.client import Client as NatsClient

from libs.contracts import (
    DEPLOYMENT_STATUS,
    PLACEMENT_DECISION,
    Assignment,
    DeploymentStatus,
    Mode,
    PlacementDecision,
    ShardProgress,
)
from libs.runtime.bus import NatsBus
from services.gateway.core.deployed import DeployedModels, Route, RouteBook
from tests.waiting import wait_until

MODEL = "smollm2-135m-instruct"


def status(deployment: str, phase: str, epoch: int, device: str) -> DeploymentStatus:
    loaded = phase == "serving"
    shard = ShardProgress(
        device_id=device,
        shard_index=0,
        state="loaded" if loaded else "loading",
        progress=1.0 if loaded else 0.5,
    )
    return DeploymentStatus(
        deployment_id=deployment,
        model=MODEL,
        phase=phase,
        epoch=epoch,
        progress=shard.progress,
        shards=(shard,),
        context_length=4096,
        ts=time.time(),
    )


async def test_the_gateway_follows_deployment_status_and_not_the_decision_broadcast(
    nc: NatsClient, uid: str
) -> None:
    bus, routes = NatsBus(nc), RouteBook()
    served = DeployedModels(routes, [])  # no scheduler URL: nothing is polled
    await routes.watch(bus, on_status=served.apply)
    await nc.flush()
    name = f"{uid}d"
    await bus.publish(DEPLOYMENT_STATUS, status(name, "loading", 1, "dev-a"), deployment_id=name)
    await wait_until(lambda: served.phase(name) == "loading", 5)
    assert served.listed == [] and routes.get(name) is None  # loading: not listed, no route
    await bus.publish(DEPLOYMENT_STATUS, status(name, "serving", 1, "dev-a"), deployment_id=name)
    await wait_until(lambda: routes.get(name) is not None, 5)
    assert served.listed == [MODEL] and served.context[name] == 4096  # listed by its model
    assert routes.get(name) == Route(name, 1, ("dev-a",))
    # A decision broadcast (a plan not loaded yet) moves nothing.
    plan = PlacementDecision(
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
    await bus.publish(PLACEMENT_DECISION, plan, task_id=name)
    other = f"{uid}e"  # published after it on the same connection: seen after it
    await bus.publish(DEPLOYMENT_STATUS, status(other, "loading", 1, "dev-e"), deployment_id=other)
    await wait_until(lambda: served.phase(other) == "loading", 5)
    assert routes.get(name) == Route(name, 1, ("dev-a",))
    # The new plan serving moves it; removal forgets it.
    await bus.publish(DEPLOYMENT_STATUS, status(name, "serving", 3, "dev-c"), deployment_id=name)
    await wait_until(lambda: routes.get(name) == Route(name, 3, ("dev-c",)), 5)
    removed = status(name, "serving", 3, "dev-c").model_copy(update={"phase": "removed"})
    await bus.publish(DEPLOYMENT_STATUS, removed, deployment_id=name)
    await wait_until(lambda: routes.get(name) is None, 5)
    assert served.listed == [] and name not in served.models
