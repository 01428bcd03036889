"""What the gateway lists and routes: only deployments that serve appear in /v1/models; a model
named while its deployment loads goes to a copy that serves; a refused one is named with the
workers' reason, not sent anywhere. All of it read from the one deployment book."""

from __future__ import annotations

import pytest

from libs.contracts import Assignment, DeploymentState
from services.gateway.core.deployed import Deployed
from services.gateway.core.errors import ApiError


def deployed(**phases: tuple[str, str, str | None]) -> Deployed:
    """Deployments by id: (model, phase, reason), each on a device of its own."""
    view = Deployed()
    for deployment, (model, phase, reason) in phases.items():
        state = DeploymentState(
            deployment_id=deployment,
            model=model,
            epoch=1,
            context_length=2048,
            assignments=(Assignment(device_id=f"dev-{deployment}", layer_end=30),),
            phase=phase,  # type: ignore[arg-type]
            reason=reason,
        )
        view.hold(state)
    return view


def test_only_serving_deployments_are_listed_and_routed() -> None:
    view = deployed(
        fresh=("smollm2-135m-instruct", "loading", None),
        smol=("smollm2-135m-instruct", "serving", None),
        waiting=("llama-3.1-8b-instruct", "pending", None),
        big=("llama-3.2-1b-instruct", "refused", "worker-0: has no weights of it"),
    )
    assert view.listed == ["smollm2-135m-instruct"]  # by name, once, serving only
    # Not the loading copy, though its id comes first.
    assert view.resolve("smollm2-135m-instruct").deployment_id == "smol"
    assert view.route("smol") is not None and view.route("fresh") is None
    assert view.loading("fresh") and not view.loading("smol")
    with pytest.raises(ApiError) as refused:
        view.resolve("big")
    assert refused.value.status == 404 and "has no weights of it" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        view.resolve("llama-3.2-1b-instruct")
    assert "has no weights of it" in str(refused.value)
    with pytest.raises(ApiError) as unknown:
        view.resolve("nothing")
    assert "serving: smollm2-135m-instruct" in str(unknown.value)
