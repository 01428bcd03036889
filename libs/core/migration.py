"""Migration planning: move a failed device's work to the best alternatives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from libs.core.catalogue import ModelSpec
from libs.core.fleet_state import FleetState
from libs.core.model import Device, Placement, Task
from libs.core.partition import Preview, choose, previews
from libs.core.policy import Policy


def replace_tasks(
    policy: Policy,
    fleet: FleetState,
    failed_device_id: str,
    tasks: Sequence[Task],
    now: float,
    rng: np.random.Generator,
) -> list[Placement]:
    """Mark the device failed and place its tasks anew with ``policy``."""
    fleet.fail(failed_device_id)
    return policy.place(fleet, tasks, now, rng)


def replan_deployment(
    model: ModelSpec,
    devices: Sequence[Device],
    failed_device_ids: set[str],
    context_length: int,
    max_shards: int,
) -> Preview:
    """A new shard plan for a model without the failed devices."""
    live = [replace(d, failed=True) if d.device_id in failed_device_ids else d for d in devices]
    return choose(previews(model, live, context_length, max_shards))
