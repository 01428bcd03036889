"""The model shipped in its PyPI package, registered when ``tessera up`` starts the cluster.

It joins the registry as any model does (``tessera models add``): its file into the cluster's
object store (once; a worker on another host fetches it there), then its card. A cluster
started with no such package registers none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

#: Seconds the shipped model's registration is tried again while the cluster's JetStream
#: does not answer yet (a NATS cluster choosing its leader).
REGISTER_WAIT_S = 60.0


def register_shipped_model(
    admin: Mapping[str, str],
    key_prefix: str,
    nats_ca: Path | None,
    deadline: float,
    say: Callable[[str, str, str], None],
) -> None:
    """Register the shipped model with the admin's ``nats`` and ``redis`` URLs, under the
    cluster's Redis ``key_prefix``, trying again until ``deadline`` (monotonic seconds) or
    ``REGISTER_WAIT_S`` from now, whichever comes first. ``say(name, message, colour)`` tells
    the console what was registered, or why nothing was; it never raises for that."""
    import asyncio

    from nats.errors import Error as NatsError
    from redis.asyncio import Redis

    from libs.models.registry import ModelRegistry
    from libs.models.shipped import ModelMissing
    from libs.runtime.nats_client import close_nats, connect_nats
    from libs.weights.object_store import WeightsError
    from libs.weights.registration import register_shipped

    async def register() -> None:
        redis = Redis.from_url(admin["redis"], decode_responses=True)
        nc = await connect_nats(admin["nats"], "launcher", ca_file=nats_ca)
        try:
            card = await register_shipped(ModelRegistry(redis, key_prefix), nc)
            say("cluster", f"model {card.name} registered ({card.file_name})", "white")
        finally:
            await close_nats(nc)
            await redis.aclose()

    # A NATS cluster's JetStream answers only once its servers have chosen a leader: what
    # times out then is tried again, for up to REGISTER_WAIT_S.
    until = min(deadline, time.monotonic() + REGISTER_WAIT_S)
    while True:
        try:
            asyncio.run(register())
            return
        except (WeightsError, NatsError, TimeoutError) as exc:
            if time.monotonic() + 1.0 < until:
                time.sleep(1.0)
                continue
            failed: Exception = exc
        except ModelMissing as exc:
            failed = exc
        # Its file could not go into the store: nothing registered (add it by hand).
        say("cluster", f"no model registered: {failed!r}", "bold yellow")
        return
