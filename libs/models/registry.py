"""The models the cluster knows, kept in its Redis: one card per name.

* ``{p}:models``          set of registered names.
* ``{p}:models:{name}``   the model's card (JSON ``ModelCard``).

A card is written whole with ``SET NX`` before its name joins the set, in one transaction,
so a name is never half-registered and a taken name is refused, not overwritten. Readers that
find a name without a card (a removal in flight) skip it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pydantic import ValidationError
from redis.asyncio import Redis

from libs.contracts.models import ModelCard
from libs.models.engine_support import unserved_reason

log = logging.getLogger(__name__)


class ModelError(ValueError):
    """A model cannot be registered or found; the message says why."""


class NameTaken(ModelError):
    pass


class UnknownModel(ModelError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelRegistry:
    def __init__(self, redis: Redis, prefix: str = "tessera") -> None:
        self.redis, self.prefix = redis, prefix

    @property
    def names_key(self) -> str:
        return f"{self.prefix}:models"

    def card_key(self, name: str) -> str:
        return f"{self.prefix}:models:{name}"

    async def add(self, card: ModelCard, engines: Iterable[str] | None = None) -> ModelCard:
        """Register ``card`` under its name. ``engines``: the engines the cluster runs (None:
        not checked); a model none of them serves is refused, naming each one's reason."""
        if engines is not None:
            engines = sorted(set(engines))
            reasons = [unserved_reason(e, card) for e in engines]
            if engines and all(reasons):
                raise ModelError(
                    f"no engine in the cluster serves {card.name}: "
                    + "; ".join(r for r in reasons if r)
                )
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.card_key(card.name), card.model_dump_json(), nx=True)
            pipe.sadd(self.names_key, card.name)
            written, _ = await pipe.execute()
        if not written:
            # SADD of a name already there changed nothing: the older card stands.
            raise NameTaken(
                f"a model named {card.name!r} is already registered; "
                "choose another name (--name) or remove it first"
            )
        log.info("model registered", extra={"model": card.name, "sha256": card.sha256})
        return card

    async def get(self, name: str) -> ModelCard | None:
        raw = await self.redis.get(self.card_key(name))
        if raw is None:
            return None
        try:
            return ModelCard.model_validate_json(raw)
        except ValidationError:
            log.error("unreadable model card", extra={"model": name})
            return None

    async def card(self, name: str) -> ModelCard:
        """The card of ``name``; ``UnknownModel`` (naming the registered ones) if none."""
        found = await self.get(name)
        if found is None:
            known = ", ".join(sorted(await self.names())) or "none"
            raise UnknownModel(
                f"unknown model {name!r}; registered: {known} "
                "(add one with `tessera models add FILE.gguf`)"
            )
        return found

    async def names(self) -> set[str]:
        return {
            n.decode() if isinstance(n, bytes) else n
            for n in await self.redis.smembers(self.names_key)
        }

    async def list(self) -> list[ModelCard]:
        names = sorted(await self.names())
        if not names:
            return []
        raws = await self.redis.mget([self.card_key(n) for n in names])
        cards = []
        for raw in raws:
            if raw is None:
                continue
            try:
                cards.append(ModelCard.model_validate_json(raw))
            except ValidationError:
                continue
        return cards

    async def by_sha256(self, sha256: str) -> ModelCard | None:
        """A registered model of this very file, if any."""
        return next((c for c in await self.list() if c.sha256 == sha256), None)

    async def remove(self, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.card_key(name))
            pipe.srem(self.names_key, name)
            deleted, _ = await pipe.execute()
        if deleted:
            log.info("model removed", extra={"model": name})
        return bool(deleted)


def register_sync(redis_url: str, prefix: str, card: ModelCard) -> bool:
    """Register ``card`` from code without an event loop (a launcher, a test's fixture);
    False when its name is taken (the older card stands)."""
    from redis import Redis as SyncRedis

    client = SyncRedis.from_url(redis_url, decode_responses=True)
    try:
        registry = ModelRegistry(client, prefix)  # type: ignore[arg-type]
        with client.pipeline(transaction=True) as pipe:
            pipe.set(registry.card_key(card.name), card.model_dump_json(), nx=True)
            pipe.sadd(registry.names_key, card.name)
            written, _ = pipe.execute()
        return bool(written)
    finally:
        client.close()
