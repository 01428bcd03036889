"""Scheduler checkpoints in two places: a Redis list (newest first) and a JetStream KV bucket
(with history), so either store alone can restore the scheduler. A checkpoint that does not
validate is reported and skipped for the one before it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

from nats.aio.client import Client as NatsClient
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from redis.asyncio import Redis

from libs.contracts import CHECKPOINT, ContractError, PlacementRequest, SchedulerCheckpoint
from libs.contracts.keys import Keys
from libs.deployments import DeploymentBook
from libs.runtime.cancelling import stopping
from libs.runtime.nats_client import copies
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.mode_keeper import ModeKeeper
from services.scheduler.state import TaskState

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


def checkpoint_of(
    book: DeploymentBook,
    modes: ModeKeeper,
    tasks: TaskState,
    queue: Sequence[PlacementRequest],
    now: float,
    factors: Mapping[str, float] | None = None,
) -> SchedulerCheckpoint:
    """What a checkpoint holds: the deployment book, the mode and policy, the decisions,
    the requests waiting, the counters and the prediction's corrections."""
    return SchedulerCheckpoint(
        ts=now,
        mode=modes.mode,
        policy=modes.policy_name,
        weights=modes.weights(),
        deployments=tuple(book),
        deployment_index=book.index,
        placements=tuple(tasks.decisions),
        queue=tuple(queue),
        counters=dict(tasks.counters) | {"mode_changes": modes.changes},
        factors=dict(factors or {}),
    )


class Checkpointer:
    """Stores the snapshots the scheduler offers, one at a time, the newest first: the loop
    takes a snapshot (``offer``) without waiting for the stores; a writer task stores it."""

    def __init__(self, store: CheckpointStore, metrics: SchedulerMetrics) -> None:
        self.store, self.metrics = store, metrics
        self._snapshot: SchedulerCheckpoint | None = None  #: the newest, not yet stored
        self._to_write = asyncio.Event()
        self._writing: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._writing = asyncio.create_task(self._writer())

    async def stop(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writing
            self._writing = None

    def offer(self, snapshot: SchedulerCheckpoint) -> None:
        """Store ``snapshot`` soon, in place of any older one not stored yet."""
        self._snapshot = snapshot
        self._to_write.set()

    async def write(self) -> None:
        """Store the newest snapshot now (at shutdown)."""
        self._to_write.clear()
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            await self.store.save(snapshot)
            self.metrics.checkpoint_timestamp.set(snapshot.ts)

    async def _writer(self) -> None:
        while not stopping():
            await self._to_write.wait()
            try:
                await self.write()
            except Exception:  # the next snapshot is written again; keep deciding
                log.exception("checkpoint not written")
                await asyncio.sleep(1.0)
