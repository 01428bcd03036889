"""Where the cluster placed a model, as its gateway says (``GET /v1/cluster/placements``)."""

from __future__ import annotations

import httpx


def model_devices(url: str, deployment_id: str) -> list[str]:
    """The devices of ``deployment_id``'s shards, in shard order, from the gateway at ``url``
    (whichever scheduler replica leads answers); none while it cannot be asked."""
    try:
        rows = httpx.get(f"{url}/v1/cluster/placements", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return []
    if not isinstance(rows, list):
        return []
    for row in rows:
        if row["deployment_id"] == deployment_id:
            ordered = sorted(row["assignments"], key=lambda a: a["shard_index"])
            return [a["device_id"] for a in ordered]
    return []
