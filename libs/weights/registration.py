"""The shipped model registered as ``tessera models add`` registers any model: its file put into
the cluster's object store, then its card into the model registry (``tessera up`` and the
compose stack's ``models`` service)."""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

from libs.contracts.models import ModelCard
from libs.models.registry import ModelRegistry, NameTaken
from libs.models.shipped import MODEL_NAME, gguf_path, shipped_card
from libs.weights.whole_files import publish


async def register_shipped(
    registry: ModelRegistry, connection: NatsClient | None = None
) -> ModelCard:
    """Register the shipped model as ``tessera models add`` does: its file put into the
    cluster's object store first (``connection``: one allowed to write it; once, a file the
    store holds already is not sent again), so that a worker on another host fetches it, then
    its card. A model of that name registered already stays (a cluster started again over the
    same Redis keeps its registry); its weights are put back when that name is this file."""
    card = shipped_card()
    known = await registry.get(MODEL_NAME)
    if known is not None and known.sha256 != card.sha256:
        return known  # the name is another file's: neither touched
    if connection is not None:
        await publish(connection, gguf_path(), card.sha256)
    if known is not None:
        return known
    try:
        return await registry.add(card)
    except NameTaken:  # another launcher registered it meanwhile
        return await registry.card(MODEL_NAME)
