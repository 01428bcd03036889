"""The scorer: telemetry in, five-dimension scores out to Redis, failures detected.

Handlers only buffer; a flush every ``flush_interval_ms`` coalesces the buffer per device,
writes raw metrics for every sample in one Redis pipeline, and re-scores (vectorised) the
devices whose state changed significantly or whose score is older than the re-score interval.
A detector loop declares devices failed after the configured number of missed heartbeats (a
device's telemetry sample is its heartbeat: no other message keeps it alive).

Write, then announce: SCORE, DEVICE_FAILED and DEVICE_RECOVERED go out only once the Redis
pipeline that stores what they announce has executed, so a subscriber that reads Redis on
receipt finds the new row.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel
from redis.asyncio import Redis

from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    DEVICE_FAILED,
    DEVICE_LEAVING,
    DEVICE_RECOVERED,
    MODE_CHANGE,
    SCORE,
    TELEMETRY,
    AnnounceRequest,
    DeviceAnnounce,
    DeviceFailed,
    DeviceLeaving,
    DeviceRecovered,
    DeviceState,
    Mode,
    ModeChange,
    ScoreUpdate,
    TelemetrySample,
)
from libs.contracts.channels import Channel
from libs.contracts.keys import SCORE_FIELDS, DeviceField, Keys, StatsField, scored_fields
from libs.contracts.profiles import DimensionWeights
from libs.core.profiles import BUILTIN_PROFILES
from libs.core.scoring import score_batch, uptime_and_failure_rate
from libs.runtime.bus import Bus, Delivery
from libs.runtime.lifecycle import Background
from services.scorer.histories import load_histories, save_history, stored_records
from services.scorer.metrics import DeviceCollector, ScorerMetrics
from services.scorer.settings import ScorerSettings
from services.scorer.table import DeviceRecord, check_speeds, significant

log = logging.getLogger(__name__)

#: How long past a deadline the detector wakes (the deadline itself is not yet overdue).
DEADLINE_MARGIN_S = 0.005
STOP_FLUSH_S = 5.0  #: the last flush's bound when stopping (a ServiceProcess kills after 15 s)
#: A message to publish once the write it announces has executed: (channel, message, device).
Event = tuple[Channel[Any], BaseModel, str]


class Scorer:
    def __init__(
        self,
        settings: ScorerSettings,
        bus: Bus,
        redis: Redis,
        metrics: ScorerMetrics,
        clock: Callable[[], float] = time.time,
        connected: Callable[[], bool] = lambda: True,
    ) -> None:
        self.settings, self.bus, self.redis = settings, bus, redis
        self.metrics, self.clock, self.connected = metrics, clock, connected
        self.deaf = False  #: NATS out of reach (``connected``) at the last detector pass
        self.keys = Keys(settings.key_prefix)
        self.table: dict[str, DeviceRecord] = {}
        self.next_deadline = math.inf  #: the earliest deadline of a live device (clock s)
        self.buffer: list[tuple[TelemetrySample, bytes]] = []
        self.announces: dict[str, DeviceAnnounce] = {}
        self.unknown_until: dict[str, float] = {}
        self.rejects: Counter[str] = Counter()
        self.mode = Mode.BALANCED
        #: The active profile's dimension weights, when the scheduler set a custom profile.
        self.custom_weights: DimensionWeights | None = None
        self.rescore_all = False
        #: Every announce seen, to write back if Redis comes back empty (restarted, no disk).
        self.known: dict[str, DeviceAnnounce] = {}
        self.background = Background("scorer")
        metrics.registry.register(DeviceCollector(lambda: list(self.table.values())))

    @property
    def weights(self) -> tuple[float, float, float, float, float]:
        """w1–w5: the active profile's (``PUT /policy``), else the mode's built-in ones."""
        chosen = self.custom_weights or BUILTIN_PROFILES[self.mode].dimensions
        return chosen.as_tuple()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        stored, weights = await self.redis.mget([self.keys.mode, self.keys.weights])
        if stored in {m.value for m in Mode}:
            self.mode = Mode(str(stored))
        if weights:
            self.custom_weights = DimensionWeights.model_validate_json(weights)
        # The marker a flush finds missing when Redis lost what was written (see ``flush``).
        await self.redis.hsetnx(self.keys.stats, StatsField.SINCE, self.clock())
        rejected = self.on_rejected
        self.background.subscriptions += [
            await self.bus.subscribe(ANNOUNCE, self.on_announce, rejected=rejected),
            await self.bus.subscribe(TELEMETRY, self.on_telemetry, rejected=rejected),
            await self.bus.subscribe(DEVICE_LEAVING, self.on_leaving, rejected=rejected),
            await self.bus.subscribe(MODE_CHANGE, self.on_mode, rejected=rejected),
        ]
        # Agents that announced before we subscribed (or while we were down) announce again.
        request = AnnounceRequest(reason="scorer started", ts=self.clock())
        await self.bus.publish(ANNOUNCE_REQUEST, request)
        self.background.every(self.settings.flush_interval_ms / 1000, self.flush)
        # The detector also wakes at the earliest deadline, so a silent device is declared
        # failed as its third heartbeat is missed, not up to a detector interval later.
        self.background.every(self.settings.detector_interval_s, self.detect, self.due_in_s)

    async def stop(self) -> None:
        await self.background.close()
        try:  # bounded: a Redis that does not answer (no reply timeout) must not hold the exit
            await asyncio.wait_for(self.flush(), STOP_FLUSH_S)
        except TimeoutError:
            log.warning("last flush dropped: redis did not answer", extra={"after_s": STOP_FLUSH_S})

    # -- handlers (cheap: they only record) -------------------------------------------------
    def on_rejected(self, channel: str, reason: str, detail: str) -> None:
        self.rejects[reason] += 1
        self.metrics.rejected.labels(channel, reason).inc()

    async def on_announce(self, announce: DeviceAnnounce, msg: Delivery) -> None:
        self.announces[announce.device_id] = announce

    async def on_telemetry(self, sample: TelemetrySample, msg: Delivery) -> None:
        self.buffer.append((sample, msg.data))  # the bytes were just validated: store as-is

    async def on_leaving(self, leaving: DeviceLeaving, msg: Delivery) -> None:
        device_id, now = leaving.device_id, self.clock()
        if device_id not in self.table:  # only Redis knows it (revoked while all was down)
            model = self.settings.model_type
            self.table.update(await stored_records(self.redis, self.keys, [device_id], now, model))
        if (record := self.table.get(device_id)) is not None:
            record.leave()
            self.next_deadline = 0.0  # the detector looks now
            log.info("device leaving", extra={"device_id": device_id})

    async def on_mode(self, change: ModeChange, msg: Delivery) -> None:
        if change.mode != self.mode or change.weights != self.custom_weights:
            self.mode, self.custom_weights = change.mode, change.weights
            self.rescore_all = True
            log.info(
                "mode changed",
                extra={"mode": change.mode.value, "reason": change.reason, "weights": self.weights},
            )

    # -- flush --------------------------------------------------------------------------------
    async def flush(self) -> None:
        samples, self.buffer = self.buffer, []
        announces, self.announces = self.announces, {}
        if not (samples or announces or self.rejects or self.rescore_all):
            return
        started = time.perf_counter()
        now = self.clock()
        if announces:
            await self._register(list(announces.values()), now)
        latest: dict[str, TelemetrySample] = {}
        raw: dict[str, bytes] = {}
        per_device: Counter[str] = Counter()
        for sample, data in samples:
            latest[sample.device_id] = sample
            raw[sample.device_id] = data
            per_device[sample.device_id] += 1
        await self._resolve_unknown(latest, per_device, now)
        measured = bool(announces)  # new claims are checked against the measurements kept
        for sample, _ in samples:
            record = self.table.get(sample.device_id)
            if record is not None and sample.measured_gflops:
                record.measured.append(sample.measured_gflops)
                measured = True
        rescaled = check_speeds(self.table) if measured else []
        for record in rescaled:
            if record.speed_scale < 1.0:
                log.warning(
                    "device overstates its speed; its measured speed is used",
                    extra={"device_id": record.device_id, "scale": round(record.speed_scale, 3)},
                )
        pipe = self.redis.pipeline(transaction=False)
        events: list[Event] = []  # published once the pipeline has executed
        misses = self.settings.heartbeat_misses
        due = []
        for device_id, sample in latest.items():
            record = self.table[device_id]
            if record.leaving:
                continue
            record.touch(now, misses)
            record.latest = sample
            if record.failed:
                self._recover(record, now, pipe, events)
            pipe.hset(self.keys.device(device_id), DeviceField.SAMPLE, raw[device_id])
            stale = record.last_scored_at is None or (
                now - record.last_scored_at >= self.settings.rescore_interval_s
            )
            if self.rescore_all or stale or significant(record.last_scored, sample, self.settings):
                due.append(record)
        due += [r for r in rescaled if r not in due and r.latest is not None and not r.failed]
        if self.rescore_all:
            due = [r for r in self.table.values() if r.latest is not None and not r.failed]
            self.rescore_all = False
        if due:
            self._rescore(due, now, pipe, events)
        counted = sum(per_device[d] for d in latest)
        # Set only if missing: a 1 back means Redis lost what we wrote (the marker is set at
        # start), so every device is written again at once rather than when next rescored.
        marker = len(pipe)
        pipe.hsetnx(self.keys.stats, StatsField.SINCE, now)
        if counted:
            pipe.hincrby(self.keys.stats, StatsField.PROCESSED, counted)
        for reason, count in self.rejects.items():
            pipe.hincrby(self.keys.stats, f"rejected:{reason}", count)
        self.rejects.clear()
        results = await pipe.execute()
        await self._announce(events)
        if results[marker] == 1 and self.known:
            await self._rewrite(now)
        self.metrics.samples.inc(counted)
        self.metrics.flush_seconds.observe(time.perf_counter() - started)

    async def _register(self, announces: list[DeviceAnnounce], now: float) -> None:
        """Record announced devices; load the history of new ones and store every announce,
        in one round trip."""
        new = [a for a in announces if a.device_id not in self.table]
        histories = await load_histories(self.redis, self.keys, [a.device_id for a in new], now)
        pipe = self.redis.pipeline(transaction=False)
        for announce in announces:
            existing = self.table.get(announce.device_id)
            history = existing.history if existing else histories[announce.device_id]
            record = DeviceRecord.from_announce(announce, history, now, self.settings.model_type)
            if existing:
                record.failed, record.last_seen = existing.failed, existing.last_seen
                record.measured = existing.measured  # checked against the new claims now
                record.latest = existing.latest
            record.touch(now, self.settings.heartbeat_misses)
            self.table[announce.device_id] = record
            self.unknown_until.pop(announce.device_id, None)
            pipe.set(self.keys.caps(announce.device_id), announce.model_dump_json())
            self.known[announce.device_id] = announce
        await pipe.execute()

    async def _rewrite(self, now: float) -> None:
        """Redis came back empty: store every device's announce and scores again now."""
        log.warning("redis lost the scores; writing them again", extra={"devices": len(self.known)})
        pipe = self.redis.pipeline(transaction=False)
        for device_id, announce in self.known.items():
            pipe.set(self.keys.caps(device_id), announce.model_dump_json())
        await pipe.execute()
        self.rescore_all = True

    async def _resolve_unknown(
        self, latest: dict[str, TelemetrySample], per_device: Counter[str], now: float
    ) -> None:
        """Load announces of devices this process has not seen (e.g. after a restart) from
        Redis; samples of devices nobody announced are rejected as ``unknown_device``."""
        unknown = [d for d in latest if d not in self.table]
        if not unknown:
            return
        lookup = [d for d in unknown if self.unknown_until.get(d, 0.0) <= now]
        loaded = await stored_records(self.redis, self.keys, lookup, now, self.settings.model_type)
        self.table.update(loaded)
        for device_id in (d for d in unknown if d not in loaded):
            del latest[device_id]
            self.unknown_until[device_id] = now + self.settings.unknown_device_cache_s
            for _ in range(per_device[device_id]):
                self.on_rejected(TELEMETRY.name, "unknown_device", device_id)

    def _rescore(self, due: list[DeviceRecord], now: float, pipe: Any, events: list[Event]) -> None:
        samples = [r.latest for r in due]
        assert all(s is not None for s in samples)

        def column(values: list[float]) -> np.ndarray:
            return np.asarray(values, dtype=np.float64)

        uptime, failure_rate = uptime_and_failure_rate(
            column([now - r.history.first_seen for r in due]),
            column([r.history.down_s for r in due]),
            column([float(r.history.failures) for r in due]),
        )
        dims = score_batch(
            compute=column([r.compute for r in due]),
            fp32_tflops=column([r.claimed.fp32_tflops * r.speed_scale for r in due]),
            memory_type_score=column([r.memory_type_score for r in due]),
            typical_power_w=column([r.typical_power_w for r in due]),
            memory_available_gb=column([s.memory_available_gb for s in samples]),  # type: ignore[union-attr]
            network_bandwidth_mbps=column([s.network_bandwidth_mbps for s in samples]),  # type: ignore[union-attr]
            network_rtt_ms=column([s.network_rtt_ms for s in samples]),  # type: ignore[union-attr]
            uptime_ratio=uptime,
            failure_rate=failure_rate,
            weights=self.weights,
            reference_need_gb=self.settings.reference_need_gb,
        )
        ttl = int(max(60.0, 4 * self.settings.rescore_interval_s))
        for i, record in enumerate(due):
            row = dims.row(i)
            key = self.keys.device(record.device_id)
            fields = scored_fields(row, record.device_class, now, self.mode, record.speed_scale)
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ttl)
            record.last_scored_at, record.last_scored = now, record.latest
            record.scores = row
            assert record.latest is not None  # ``due`` holds sampled devices only
            update = ScoreUpdate(
                device_id=record.device_id,
                device_class=record.device_class,
                ts=now,
                mode=self.mode,
                **row,
                sample=record.latest,
                speed_scale=record.speed_scale,
                announced_ts=record.announced_ts,
            )
            events.append((SCORE, update, record.device_id))
        for name in SCORE_FIELDS:
            values = getattr(dims, name)
            pipe.zadd(
                self.keys.rank(name),
                {r.device_id: float(values[i]) for i, r in enumerate(due)},
            )

    # -- liveness -----------------------------------------------------------------------------
    def due_in_s(self) -> float:
        """Seconds until just past the earliest deadline the last detector pass saw."""
        return self.next_deadline - self.clock() + DEADLINE_MARGIN_S

    async def detect(self) -> None:
        now = self.clock()
        if not self.connected():  # NATS out of reach: a silence that is not the devices'
            self.deaf, self.next_deadline = True, now + 0.25  # looked at again soon
            return
        if self.deaf:  # heard again: each device gets its full window to report anew
            self.deaf = False
            for record in self.table.values():
                record.touch(now, self.settings.heartbeat_misses)
        live = [r for r in self.table.values() if not r.failed]
        overdue = [r for r in live if now > r.deadline]
        # Deadlines only move later as devices are heard from (a leaving one is due at once,
        # and waits at most an interval, as before), so this is the next one to check.
        self.next_deadline = min((r.deadline for r in live if now <= r.deadline), default=math.inf)
        if not overdue:
            return
        pipe = self.redis.pipeline(transaction=False)
        events: list[Event] = []
        for record in overdue:
            record.failed = True
            record.history.failures += 1
            record.history.down_since = record.last_seen
            pipe.hset(self.keys.device(record.device_id), DeviceField.STATE, DeviceState.FAILED)
            pipe.sadd(self.keys.failed, record.device_id)
            for name in SCORE_FIELDS:
                pipe.zrem(self.keys.rank(name), record.device_id)
            save_history(self.keys, record, pipe)
            event = DeviceFailed(
                device_id=record.device_id,
                ts=now,
                last_seen_ts=record.last_seen,
                missed_heartbeats=self.settings.heartbeat_misses,
            )
            events.append((DEVICE_FAILED, event, record.device_id))
            self.metrics.failures.inc()
            log.warning(
                "device failed",
                extra={"device_id": record.device_id, "silent_s": round(now - record.last_seen, 2)},
            )
        await pipe.execute()
        await self._announce(events)

    async def _announce(self, events: list[Event]) -> None:
        """Publish what a pipeline just stored (called only after it executed)."""
        for channel, message, device_id in events:
            await self.bus.publish(channel, message, device_id=device_id)

    def _recover(self, record: DeviceRecord, now: float, pipe: Any, events: list[Event]) -> None:
        down_since = record.history.down_since or now
        record.history.down_s += max(0.0, now - down_since)
        record.history.down_since = None
        record.failed = False
        record.last_scored_at = None  # re-score now
        pipe.srem(self.keys.failed, record.device_id)
        save_history(self.keys, record, pipe)
        event = DeviceRecovered(device_id=record.device_id, ts=now, down_for_s=now - down_since)
        events.append((DEVICE_RECOVERED, event, record.device_id))
        self.metrics.recoveries.inc()
        log.info("device recovered", extra={"device_id": record.device_id})
