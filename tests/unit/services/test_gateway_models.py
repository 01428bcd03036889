"""What the gateway lists and routes: only deployments that serve appear in /v1/models; a model
named while its deployment loads goes to a copy that serves; a refused one is named with the
workers' reason, not sent anywhere."""

from __future__ import annotations

import pytest

from services.gateway.core.deployed import DeployedModels, Route, RouteBook
from services.gateway.core.errors import ApiError


def book(**phases: tuple[str, str, str | None]) -> DeployedModels:
    """Deployments by id: (model, phase, reason), each routed to a device of its own."""
    deployments = DeployedModels(RouteBook(), [])
    for deployment, (model, phase, reason) in phases.items():
        deployments.models[deployment] = model
        deployments.phases[deployment] = (phase, reason)
        deployments.routes.set(Route(deployment, 1, (f"dev-{deployment}",)))
    return deployments


def test_only_serving_deployments_are_listed_and_routed() -> None:
    deployments = book(
        smol=("smollm2-135m-instruct", "serving", None),
        fresh=("smollm2-135m-instruct", "loading", None),
        waiting=("llama-3.1-8b-instruct", "pending", None),
        big=("llama-3.2-1b-instruct", "refused", "worker-0: has no weights of it"),
    )
    assert deployments.listed == ["smollm2-135m-instruct"]  # by name, once, serving only
    assert deployments.resolve("smollm2-135m-instruct") == "smol"  # not the loading copy
    with pytest.raises(ApiError) as refused:
        deployments.resolve("big")
    assert refused.value.status == 404 and "has no weights of it" in str(refused.value)
    with pytest.raises(ApiError):
        deployments.resolve("llama-3.2-1b-instruct")
