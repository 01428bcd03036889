"""Scheduler checkpoints in two places: a Redis list (newest first) and a JetStream KV bucket
(with history), so either store alone can restore the scheduler. A checkpoint that does not
validate is reported and skipped for the one before it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client as NatsClient
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from redis.asyncio import Redis

from libs.contracts import CHECKPOINT, ContractError, SchedulerCheckpoint
from libs.contracts.keys import Keys
from libs.runtime.nats_client import copies
from services.scheduler.loop import CommandLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import Pending, SchedulerState

log = logging.getLogger(__name__)
BUCKET = "tessera_scheduler"


class CheckpointStore:
    """``nc`` None: Redis only (the unit tests of the scheduler's handlers)."""

    def __init__(self, redis: Redis, nc: NatsClient | None, keys: Keys, kept: int) -> None:
        self.redis, self.nc, self.keys, self.kept = redis, nc, keys, kept
        self.corrupt_seen = 0

    @property
    def list_key(self) -> str:
        return f"{self.keys.prefix}:checkpoints"

    @property
    def kv_key(self) -> str:
        """One KV key per key prefix, so clusters sharing a NATS server stay apart."""
        return self.keys.prefix.replace(":", ".") + ".checkpoint"

    async def _bucket(self) -> KeyValue:
        if self.nc is None:
            raise RuntimeError("no NATS key-value store")
        js = self.nc.jetstream()
        try:
            return await js.key_value(BUCKET)
        except BucketNotFoundError:
            return await js.create_key_value(
                bucket=BUCKET, history=min(self.kept, 64), replicas=copies(self.nc)
            )

    async def save(self, checkpoint: SchedulerCheckpoint) -> None:
        data = CHECKPOINT.encode(checkpoint)
        pipe = self.redis.pipeline(transaction=True)
        pipe.lpush(self.list_key, data)
        pipe.ltrim(self.list_key, 0, self.kept - 1)
        await pipe.execute()
        try:
            await (await self._bucket()).put(self.kv_key, data)
        except Exception as exc:  # Redis holds it; the KV copy is the second line
            log.warning("checkpoint not written to NATS KV", extra={"error": repr(exc)})

    async def load(self) -> SchedulerCheckpoint | None:
        """The newest checkpoint that validates, from Redis, else from the KV history."""
        candidates = [
            bytes(c) if isinstance(c, bytes) else str(c).encode()
            for c in await self.redis.lrange(self.list_key, 0, -1)
        ]
        if not candidates:
            candidates = await self._kv_history()
        for data in candidates:
            try:
                return CHECKPOINT.decode(data)
            except ContractError as exc:
                self.corrupt_seen += 1
                log.error(
                    "corrupt checkpoint skipped",
                    extra={"reason": exc.reason, "detail": exc.detail[:200]},
                )
        return None

    async def _kv_history(self) -> list[bytes]:
        if self.nc is None:
            return []
        try:
            entries = await (await self._bucket()).history(self.kv_key)
        except (NoKeysError, NotFoundError, BucketNotFoundError):
            return []
        return [e.value for e in reversed(entries) if e.value]


class Checkpointing:
    """The scheduler's checkpoints: the loop takes the snapshot, the writer stores it.
    ``Scheduler`` (service.py) is one; what it needs is set by ``Scheduler.__init__``."""

    state: SchedulerState
    pending: list[Pending]
    clock: Callable[[], float]
    loop: CommandLoop
    checkpoints: CheckpointStore
    metrics: SchedulerMetrics
    _snapshot: SchedulerCheckpoint | None
    _to_write: asyncio.Event

    def persist(self) -> None:
        """Snapshot the state for the writer (called by commands, in the loop)."""
        self.state.queue = [r for r, _, _ in self.pending]
        self._snapshot = self.state.checkpoint(self.clock())
        self._to_write.set()

    async def save_soon(self) -> None:
        """The periodic checkpoint: snapshot in the loop's turn, stored by the writer."""

        async def snapshot() -> None:
            self.persist()

        await self.loop.call(snapshot, "checkpoint")

    async def save(self) -> None:
        """Snapshot now and store it before returning (at shutdown; the loop has stopped)."""
        self.persist()
        await self._write()

    async def _writer(self) -> None:
        while True:
            await self._to_write.wait()
            try:
                await self._write()
            except Exception:  # the next snapshot is written again; keep deciding
                log.exception("checkpoint not written")
                await asyncio.sleep(1.0)

    async def _write(self) -> None:
        self._to_write.clear()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            await self.checkpoints.save(snapshot)
            self.metrics.checkpoint_timestamp.set(snapshot.ts)
