"""A deployment's speed: predicted when its plan is made, measured by its requests (the
gateway times each one and sends what it measured), and the prediction's model corrected by
each measurement (``Planner.learn``), so the next plan on those devices is predicted closer.
"""

from __future__ import annotations

import logging

from libs.contracts import DeploymentChange, DeploymentMeasured, DeploymentState, Speed
from libs.core.partition import Preview
from libs.deployments import DeploymentBook
from services.scheduler.planning import Planner

log = logging.getLogger(__name__)


def predicted(
    planner: Planner,
    book: DeploymentBook,
    chosen: Preview,
    precision: str | None,
    now: float,
    moving: DeploymentState | None = None,
) -> Speed | None:
    """``chosen``'s predicted speed (``Planner.predicted``); ``moving``: the deployment it
    re-plans."""
    moved = None if moving is None else moving.deployment_id
    devices = {d.device_id: d for d in planner.model_devices(book, now, moved)}
    route = [(s.device_id, s.layers) for s in chosen.shards]
    return planner.predicted(chosen.model, route, devices, precision)


def measured(
    planner: Planner, book: DeploymentBook, news: DeploymentMeasured, now: float
) -> list[DeploymentChange]:
    """What a deployment's requests measured: recorded beside its prediction, and the
    prediction's model corrected by it; another plan's news is stale."""
    deployment = book.get(news.deployment_id)
    if deployment is None or deployment.epoch != news.epoch:
        return []
    devices = {d.device_id: d for d in planner.model_devices(book, now)}
    factors = planner.learn(deployment, news.measured, devices)
    if factors is not None:
        said = ", ".join(f"{d} {f:.2f}" for d, f in sorted(factors.items()))
        log.info("%s measured %.2f tokens/s at one stream: factors %s",
                 deployment.deployment_id, news.measured.tokens_per_s_1, said)  # fmt: skip
    return [news]
