"""Which deployment a request's model name means: one rule, for the gateway and the scheduler.

A name is a deployment's id (that one, whatever its phase), else a model's name: of the copies
of that model (deployments and their replicas), the one furthest along — serving, then loading
or pending, then stopped — and among equals the lowest id. The request then goes to that
copy's group (``DeploymentState.base``): the scheduler picks the serving copy in it.
"""

from __future__ import annotations

from libs.contracts import DeploymentState
from libs.deployments.book import DeploymentBook

#: How far along each phase is: lower is further (``resolve`` prefers it).
_RANK = {"serving": 0, "loading": 1, "pending": 1, "refused": 2, "failed": 2}


def resolve(name: str, book: DeploymentBook) -> DeploymentState | None:
    """The deployment ``name`` means in ``book`` (None: nothing by that name)."""
    found = book.get(name)
    if found is not None:
        return found
    copies = [d for d in book if d.model == name]
    if not copies:
        return None
    return min(copies, key=lambda d: (_RANK.get(d.phase, 3), d.deployment_id))


def serving_models(book: DeploymentBook) -> list[str]:
    """The models that serve now, by name, each once."""
    return sorted({d.model for d in book if d.phase == "serving"})


def other_groups(name: str, book: DeploymentBook) -> list[str]:
    """The model ``name`` means, deployed again apart from the group its name goes to: each
    other group (a deployment and its replicas) whose first copy serves, by its id (EdgeFlow's
    edge servers: ``libs/core/batch_policies.py``). None for a deployment's own id (other than
    the model's name): a request that names a copy wants that one."""
    main = resolve(name, book)
    if main is None or (book.get(name) is not None and name != main.model):
        return []
    return sorted(
        d.deployment_id
        for d in book
        if d.model == main.model
        and d.replica_of is None
        and d.phase == "serving"
        and d.base != main.base
    )
