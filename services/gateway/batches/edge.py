"""EdgeFlow's edge on the live runner at each step (``edgeflow``): rules 2 and 3 made safe
(``libs/core/batch_policies.py: rescued``). A batch admitted on the cloud (its model's own
deployment) that the cloud's plan now ends after its deadline (its model measured slower since
it was admitted, say) goes to an idle edge deployment of its model on which it still ends in
time, and stays there (rule 1); its requests in flight on the cloud end there. Only edge
deployments whose curve is measured are weighed (a step sends no sample requests): each is
measured the first time a batch the cloud declines is tried on it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from libs.core.batch_policies import Batch, Lane, rescued
from services.gateway.batches.lines import Progress
from services.gateway.batches.store import JobStore

log = logging.getLogger(__name__)


async def rescue(
    store: JobStore,
    lanes: Callable[[str], list[str]],
    seen: list[tuple[dict[str, Any], Batch]],
    progress: Mapping[str, Progress],
    streams: int,
) -> dict[str, str]:
    """Move the cloud's late batches of ``seen`` to idle edge deployments (``raw["lane"]``,
    their progress and the store); batch id → deployment."""
    busy = {str(raw["lane"]) for raw, _ in seen if raw.get("lane")}
    cloud = [(raw, b) for raw, b in seen if not raw.get("lane") and raw["id"] in progress]
    curves: dict[str, Lane] = {}
    idle: dict[str, list[Lane]] = {}
    for raw, batch in cloud:
        for deployment in lanes(str(raw["model"])):
            if deployment not in busy and deployment not in curves:
                curves[deployment] = Lane(deployment, await store.curve(deployment))
            if deployment in curves and curves[deployment].rates:
                idle.setdefault(batch.job_id, []).append(curves[deployment])
    if not idle:
        return {}
    moved = rescued([b for _, b in cloud], idle, time.time(), streams)
    for raw, _ in cloud:
        lane = moved.get(raw["id"])
        if lane is None:
            continue
        raw["lane"] = progress[raw["id"]].lane = lane
        decision = f"{raw.get('decision', '')}; then on the edge, deployment {lane}: the cloud's "
        await store.update(raw["id"], lane=lane, decision=decision + "plan missed its deadline")
        log.info("batch moved to the edge", extra={"batch": raw["id"], "deployment": lane})
    return moved
