"""Leadership among scheduler replicas: a lease in a NATS KV bucket whose entries expire.

Whoever creates the key leads (or finds its own name on it: a restarted leader takes it back).
The leader renews it every ``ttl_s / 3`` by compare-and-set on the revision it last wrote; a
follower tries to create it every ``ttl_s / 12`` (a take-over at most a quarter of a renewal
late), which succeeds only once the leader's entry has expired (it stopped renewing: killed,
cut off). A leader that cannot renew before ``ttl_s - margin_s``
since its last renewal steps down — the process exits without writing anything — so its
successor, which cannot take the key before ``ttl_s``, never overlaps with it: never two
leaders at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NatsClient
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from libs.runtime.nats_client import copies

log = logging.getLogger(__name__)

BUCKET = "TESSERA_LEADER"


class Lease:
    def __init__(
        self,
        nc: NatsClient,
        replica: str,
        *,
        key: str = "scheduler",
        ttl_s: float = 3.0,
        margin_s: float = 0.5,
    ) -> None:
        self.nc, self.replica, self.key = nc, replica, key
        self.ttl_s, self.margin_s = ttl_s, margin_s
        self.revision = 0
        self.renewed_at = 0.0
        self._kv: KeyValue | None = None

    async def bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream()
            try:
                self._kv = await js.key_value(BUCKET)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(
                    bucket=BUCKET, history=1, ttl=self.ttl_s, replicas=copies(self.nc)
                )
        return self._kv

    @property
    def valid(self) -> bool:
        """Whether this replica may still act as leader."""
        return self.revision > 0 and time.monotonic() < self.renewed_at + self.ttl_s - self.margin_s

    async def try_acquire(self) -> bool:
        started = time.monotonic()
        try:
            kv = await self.bucket()
            self.revision = await kv.create(self.key, self.replica.encode())
        except KeyWrongLastSequenceError:
            if not await self._reclaim(kv):
                return False  # another replica leads
        except Exception as exc:  # NATS unreachable: nobody can be sure; try again later
            log.warning("leader lease unavailable", extra={"error": repr(exc)})
            return False
        self.renewed_at = started
        log.info("leading", extra={"replica": self.replica})
        return True

    async def _reclaim(self, kv: KeyValue) -> bool:
        """The lease still names this replica: its previous life ended (killed, restarted), as
        two processes never share a replica name. Take it back at once, by compare-and-set."""
        try:
            entry = await kv.get(self.key)
            if entry.value != self.replica.encode() or entry.revision is None:
                return False
            self.revision = await kv.update(self.key, entry.value, last=entry.revision)
        except Exception:  # expired or taken meanwhile: not ours
            return False
        return True

    async def _resume(self) -> bool:
        """The lease expired while NATS was out of reach (restarting) and nobody wrote it
        since: the bucket's last write is still this replica's renewal, so no other replica
        led meanwhile. Create it again (only if still absent); False: another took it."""
        try:
            info = await self.nc.jetstream().stream_info(f"KV_{BUCKET}")
            if info.state.last_seq != self.revision:
                return False
            self.revision = await (await self.bucket()).create(self.key, self.replica.encode())
        except Exception:  # taken meanwhile, or NATS gone again: not ours
            return False
        return True

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            if await self.try_acquire():
                return True
            await pause(stop, self.ttl_s / 12)
        return False

    async def renew(self) -> bool:
        """Extend the lease; False once it is lost (taken, or not renewed in time)."""
        started = time.monotonic()
        try:
            self.revision = await (await self.bucket()).update(
                self.key, self.replica.encode(), last=self.revision
            )
        except KeyWrongLastSequenceError:
            if await self._resume():
                log.warning(
                    "leader lease expired unseen and taken again", extra={"replica": self.replica}
                )
                self.renewed_at = started
                return True
            log.error("leader lease taken by another replica", extra={"replica": self.replica})
            self.revision = 0
            return False
        except Exception as exc:
            log.warning("leader lease not renewed", extra={"error": repr(exc)})
            return self.valid
        self.renewed_at = started
        return True

    async def hold(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        """Renew until ``stop``; set ``lost`` (and return) the moment the lease is gone."""
        while not stop.is_set():
            if not await self.renew():
                lost.set()
                return
            await pause(stop, self.ttl_s / 3)

    async def release(self) -> None:
        """Give the lease up at a clean stop, so a follower takes over at once."""
        if self.revision > 0:
            try:
                await (await self.bucket()).delete(self.key, last=self.revision)
            except Exception as exc:
                log.info("lease not released", extra={"error": repr(exc)})
            self.revision = 0


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
