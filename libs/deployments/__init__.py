"""What is deployed, as one value: the deployment book, its events, its one name rule.

- ``book.py``: ``DeploymentBook`` (immutable), ``apply`` (one change), ``record`` (the
  scheduler numbers its changes as events), ``follow`` (a follower applies them in order).
- ``phases.py``: a deployment's phase from its workers' reports.
- ``resolve.py``: the deployment a model name means.

Pure: imports nothing but ``libs.contracts``. The scheduler writes the book; the gateway, the
dashboard and the CLI follow it.
"""

from libs.deployments.book import DeploymentBook, apply, follow, record
from libs.deployments.resolve import other_groups, resolve, serving_models

__all__ = [
    "DeploymentBook",
    "apply",
    "follow",
    "other_groups",
    "record",
    "resolve",
    "serving_models",
]
