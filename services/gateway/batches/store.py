"""The Batch API's files and batches, kept in the cluster's Redis (its home's append-only file:
they outlive a restart of the gateway and of the cluster).

Keys, under ``<prefix>:jobs:``: ``file:<id>`` (a hash: the file object as JSON, and its text),
``files`` (ids by creation time), ``batch:<id>`` (a hash, one field per attribute, so that the
runner's counts and a cancel written by a route never overwrite each other), ``batches``,
``active`` (the ids of those not yet ended), and each batch's answers in ``ok:<id>`` and
``err:<id>`` (custom id → output line): a request is pending until its custom id is in one of
them, and set there once (``HSETNX``), so a request run twice after a restart is kept once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from services.gateway.core.ids import new_id

#: A batch's statuses, as OpenAI names them; the last four are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")
_MORE_TIMES = ("cancelling_at", "cancelled_at", "planned_finish_at")


class JobStore:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis, self.p = redis, f"{prefix}:jobs"

    # -- files -------------------------------------------------------------------------------
    async def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file: dict[str, Any] = {
            "id": new_id("file"),
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
        }
        pipe = self.redis.pipeline(transaction=True)
        data = content.decode()  # the routes take UTF-8 text only (JSONL)
        pipe.hset(f"{self.p}:file:{file['id']}", mapping={"meta": json.dumps(file), "data": data})
        pipe.zadd(f"{self.p}:files", {file["id"]: time.time()})
        await pipe.execute()
        return file

    async def file(self, file_id: str) -> dict[str, Any] | None:
        meta = await self.redis.hget(f"{self.p}:file:{file_id}", "meta")
        return json.loads(meta) if meta else None

    async def content(self, file_id: str) -> bytes | None:
        data = await self.redis.hget(f"{self.p}:file:{file_id}", "data")
        return None if data is None else _text(data).encode()

    async def files(self, limit: int) -> list[dict[str, Any]]:
        ids = await self.redis.zrevrange(f"{self.p}:files", 0, limit - 1)
        found = [await self.file(_text(i)) for i in ids]
        return [f for f in found if f is not None]

    async def delete_file(self, file_id: str) -> bool:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(f"{self.p}:file:{file_id}")
        pipe.zrem(f"{self.p}:files", file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    # -- batches ------------------------------------------------------------------------------
    async def add_batch(self, fields: dict[str, Any]) -> str:
        batch_id = new_id("batch")
        now = time.time()
        record = {"id": batch_id, "created_at": int(now), **fields}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(f"{self.p}:batch:{batch_id}", mapping=_encoded(record))
        pipe.zadd(f"{self.p}:batches", {batch_id: now})
        pipe.sadd(f"{self.p}:active", batch_id)
        await pipe.execute()
        return batch_id

    async def active_ids(self) -> list[str]:
        """The batches not yet ended."""
        return sorted(_text(i) for i in await self.redis.smembers(f"{self.p}:active"))

    async def ended(self, batch_id: str, **fields: Any) -> None:
        """The batch's final fields written, and it is no longer active, in one step."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(f"{self.p}:batch:{batch_id}", mapping=_encoded(fields))
        pipe.srem(f"{self.p}:active", batch_id)
        await pipe.execute()

    async def update(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(f"{self.p}:batch:{batch_id}", mapping=_encoded(fields))

    async def cancel(self, batch_id: str) -> None:
        """Mark a running batch ``cancelling``; one that ended (even a moment ago, while this
        looked) keeps its status."""
        key = f"{self.p}:batch:{batch_id}"
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    status = json.loads(await pipe.hget(key, "status") or "null")
                    if status not in ACTIVE or status == "cancelling":
                        return
                    pipe.multi()  # type: ignore[no-untyped-call]
                    fields = {"status": "cancelling", "cancelling_at": int(time.time())}
                    pipe.hset(key, mapping=_encoded(fields))
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # the runner wrote it meanwhile: look again

    async def raw(self, batch_id: str) -> dict[str, Any] | None:
        stored = await self.redis.hgetall(f"{self.p}:batch:{batch_id}")
        return {_text(k): json.loads(v) for k, v in stored.items()} if stored else None

    async def batch_ids(self, limit: int, after: str | None = None) -> list[str]:
        ids = [_text(i) for i in await self.redis.zrevrange(f"{self.p}:batches", 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        return ids[:limit]

    async def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch as OpenAI's Batch object (with Tessera's ``model``, ``planned_finish_at``
        and ``decision``)."""
        raw = await self.raw(batch_id)
        if raw is None:
            return None
        ok, err = await self.counts(batch_id)
        out = {
            "id": batch_id,
            "object": "batch",
            "endpoint": raw["endpoint"],
            "errors": raw.get("errors"),
            "input_file_id": raw["input_file_id"],
            "completion_window": raw["completion_window"],
            "status": raw["status"],
            "output_file_id": raw.get("output_file_id"),
            "error_file_id": raw.get("error_file_id"),
            "created_at": raw["created_at"],
            "expires_at": raw["expires_at"],
            **{k: raw.get(k) for k in (*_TIMES, *_MORE_TIMES)},
            "request_counts": {"total": raw["total"], "completed": ok, "failed": err},
            "metadata": raw.get("metadata"),
            "model": raw["model"],
            "decision": raw.get("decision"),
            # edgeflow: the edge deployment it runs on (None: the model's, the cloud).
            "edge_deployment": raw.get("lane") or None,
            "devices": sorted(_text(d) for d in await self.redis.smembers(self.devices(batch_id))),
        }
        if raw.get("steps_total"):  # a training job: its progress in training steps
            done = raw.get("steps_done") or 0
            out["training"] = {"steps_done": done, "steps_total": raw["steps_total"]}
        return out

    def devices(self, batch_id: str) -> str:
        return f"{self.p}:devices:{batch_id}"

    async def add_devices(self, batch_id: str, devices: list[str]) -> None:
        """The devices that answered one of the batch's requests."""
        await self.redis.sadd(self.devices(batch_id), *devices)

    # -- answers ------------------------------------------------------------------------------
    async def answer(self, batch_id: str, custom_id: str, line: dict[str, Any], ok: bool) -> bool:
        """Keep one request's output line; False when it was kept already."""
        where = f"{self.p}:{'ok' if ok else 'err'}:{batch_id}"
        return bool(await self.redis.hsetnx(where, custom_id, json.dumps(line)))

    async def answer_many(self, batch_id: str, errors: dict[str, dict[str, Any]]) -> None:
        """Keep each custom id's error line, where it has no answer yet, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for custom_id, line in errors.items():
            pipe.hsetnx(f"{self.p}:err:{batch_id}", custom_id, json.dumps(line))
        await pipe.execute()

    async def answered(self, batch_id: str) -> set[str]:
        keys = [f"{self.p}:ok:{batch_id}", f"{self.p}:err:{batch_id}"]
        return {_text(k) for key in keys for k in await self.redis.hkeys(key)}

    async def counts(self, batch_id: str) -> tuple[int, int]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(f"{self.p}:ok:{batch_id}")
        pipe.hlen(f"{self.p}:err:{batch_id}")
        ok, err = await pipe.execute()
        return int(ok), int(err)

    async def answers(self, batch_id: str, ok: bool) -> dict[str, str]:
        stored = await self.redis.hgetall(f"{self.p}:{'ok' if ok else 'err'}:{batch_id}")
        return {_text(k): _text(v) for k, v in stored.items()}

    # -- measured throughput -------------------------------------------------------------------
    async def curve(self, model: str) -> dict[int, float]:
        """``model``'s units/s by requests at once, as measured."""
        stored = await self.redis.hgetall(f"{self.p}:rates:{model}")
        return {int(_text(k)): float(_text(v)) for k, v in stored.items()}

    async def set_rate(self, model: str, at_once: int, rate: float) -> None:
        await self.redis.hset(f"{self.p}:rates:{model}", str(at_once), f"{rate:.6g}")

    # -- the runner's lease -------------------------------------------------------------------
    async def lease(self, holder: str, ttl_s: float) -> bool:
        """Take or keep the one runner's lease (gateways share the work; one runs it)."""
        key = f"{self.p}:runner"
        if await self.redis.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        if _text(await self.redis.get(key) or b"") == holder:
            await self.redis.pexpire(key, int(ttl_s * 1000))
            return True
        return False


def _encoded(fields: dict[str, Any]) -> dict[Any, Any]:
    return {k: json.dumps(v) for k, v in fields.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value
