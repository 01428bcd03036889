"""The cluster as the scheduler sees it: the scorer's rows and the devices' announces.

Loaded once at start from the scorer's Redis keys (one pipelined read of the live devices),
then kept current by events: a score update is applied as sent (it carries the scores, the
sample they were computed from and the speed scale: the row the scorer wrote), device-failed
and device-recovered flip a device's state. Redis is read again only for a device the view
has no announce for, or whose announce is newer than the one it holds (the update says which
announce it was scored under). Nothing scans Redis per decision.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from redis.asyncio import Redis

from libs.contracts import DeviceAnnounce, DeviceClass, DeviceState, ScoreUpdate, TelemetrySample
from libs.contracts.keys import DeviceRow, Keys
from libs.core.energy import IDLE_SHARE, cluster_rates
from libs.core.model import Device, speed_gflops
from libs.runtime.redis_client import read_devices

#: Concurrent tasks a device of each class runs (its ``slots``) when its worker announces
#: none (``DeviceAnnounce.slots``).
CLASS_SLOTS = {
    DeviceClass.WATCH: 1,
    DeviceClass.PHONE: 2,
    DeviceClass.LAPTOP: 4,
    DeviceClass.WORKSTATION: 8,
    DeviceClass.EDGE_SERVER: 8,
    DeviceClass.CLOUD_GPU: 32,
}
#: Where a device reports no temperature, the scheduler's heat model starts from a room's
#: (its heat limit then binds only on the rise the work itself predicts).
ROOM_C = 25.0


def power_now(sample: TelemetrySample, typical_w: float) -> float:
    """The device's power as it reports it, else the scheduler's model of it: idle power plus
    its share of typical power by the load it reports."""
    if sample.power_w is not None:
        return sample.power_w
    return typical_w * (IDLE_SHARE + (1.0 - IDLE_SHARE) * sample.cpu_utilisation)


def vram_free(announce: DeviceAnnounce, sample: TelemetrySample, reserved_gb: float) -> float:
    """The GPU memory a placement may give this device's engine (0: it offloads to none): the
    share it announced (``vram_gb``) less what deployments hold there, and, while they hold
    none, less what the GPU has in use (another program's counts)."""
    if not announce.vram_gb or sample.gpu is None:
        return 0.0
    held = reserved_gb if reserved_gb > 0 else sample.gpu.memory_used_gb
    return max(0.0, announce.vram_gb - held)


def to_device(
    row: DeviceRow, announce: DeviceAnnounce, load: float, reserved_gb: float, vram_gb: float = 0.0
) -> Device:
    """A core ``Device`` from the scorer's row (scored, so it has a sample) and the announce;
    ``reserved_gb`` and ``vram_gb``: the host and GPU memory deployments hold there."""
    sample = row.sample
    assert sample is not None
    caps = announce.capabilities
    total = sample.memory_total_gb
    free = max(0.0, min(sample.memory_available_gb - reserved_gb, total))
    slots = announce.slots or CLASS_SLOTS[announce.device_class]
    return Device(
        device_id=row.device_id,
        device_class=announce.device_class,
        capability=row.dimensions,
        memory_total_gb=total,
        memory_free_gb=free,
        power_max_w=caps.max_power_w,
        power_now_w=min(power_now(sample, caps.typical_power_w), caps.max_power_w),
        power_idle_w=caps.typical_power_w * IDLE_SHARE,
        temperature_c=ROOM_C if sample.temperature_c is None else sample.temperature_c,
        thermal_limit_c=caps.thermal_limit_c,
        delta_t_c=caps.delta_t_c,
        # The announced speed, scaled down by the scorer when the device measures far slower.
        speed=speed_gflops(caps.fp32_tflops, row.speed_scale),
        memory_gbps=caps.memory_bandwidth_gbps * row.speed_scale,
        slots=slots,
        # The busier of what this scheduler placed there and what the device reports.
        load=max(load / slots, sample.cpu_utilisation),
        battery_percent=sample.battery_percent,
        plugged=sample.plugged if sample.plugged is not None else True,
        network_rtt_ms=sample.network_rtt_ms,
        network_bandwidth_mbps=sample.network_bandwidth_mbps,
        failed=row.state == DeviceState.FAILED,
        vram_free_gb=vram_free(announce, sample, vram_gb),
    )


#: Rows and announces read from Redis or received, to apply.
Read = list[tuple[DeviceRow, DeviceAnnounce]]


def row_of(update: ScoreUpdate) -> DeviceRow:
    """The row the scorer wrote with ``update`` (``DeviceRow.decode`` of the device's hash):
    a score update is only sent for a live device."""
    return DeviceRow(
        device_id=update.device_id,
        device_class=update.device_class,
        state=DeviceState.ALIVE,
        sample=update.sample,
        compute=update.compute,
        memory=update.memory,
        efficiency=update.efficiency,
        network=update.network,
        stability=update.stability,
        total=update.total,
        scored_at=update.ts,
        mode=update.mode,
        speed_scale=update.speed_scale,
    )


class ClusterView:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        #: The scored devices' rows, decoded once when read.
        self.rows: dict[str, DeviceRow] = {}
        self.announces: dict[str, DeviceAnnounce] = {}
        self.failed: set[str] = set()
        #: Score updates received since the last ``take_received``, the newest per device.
        self.received: dict[str, ScoreUpdate] = {}
        #: Devices that announced again since ``take_renewed`` (``apply``).
        self.renewed: set[str] = set()

    async def load(self) -> None:
        """Every device the scorer ranks, plus the failed ones, in one pipeline each."""
        live = [str(d) for d in await self.redis.zrange(self.keys.rank("total"), 0, -1)]
        self.failed = {str(d) for d in await self.redis.smembers(self.keys.failed)}
        await self.refresh(live + sorted(self.failed - set(live)))

    async def refresh(self, device_ids: list[str]) -> None:
        self.apply(await self.read(device_ids))

    async def read(self, device_ids: list[str]) -> Read:
        """The scored rows and announces of ``device_ids`` from Redis (changes nothing here:
        the scheduler reads before its command loop applies them, ``apply``)."""
        if not device_ids:
            return []
        rows = {r.device_id: r for r in await read_devices(self.redis, self.keys, device_ids)}
        found = await self.redis.mget([self.keys.caps(d) for d in device_ids])
        read: Read = []
        for device_id, caps in zip(device_ids, found, strict=True):
            row = rows.get(device_id)
            if row is None or not row.scored or caps is None:
                continue
            read.append((row, DeviceAnnounce.model_validate_json(caps)))
        return read

    def receive(self, update: ScoreUpdate) -> bool:
        """Keep a score update to apply as sent (``take_received``). False when it cannot be
        applied without Redis: the view has no announce for the device, or an older one than
        the update was scored under (``read`` then gives both)."""
        announce = self.announces.get(update.device_id)
        if announce is None or announce.ts != update.announced_ts:
            return False
        self.received[update.device_id] = update
        return True

    def take_received(self) -> Read:
        """The rows of the score updates received since the last call, with the announces
        they were scored under, for ``apply`` (changes nothing else here)."""
        received, self.received = self.received, {}
        return [(row_of(u), self.announces[u.device_id]) for u in received.values()]

    def apply(self, read: Read) -> None:
        """Take ``read``, noting in ``renewed`` the devices that announced themselves again
        since the view last heard them (a worker started again: it holds no shard, and may
        listen elsewhere)."""
        for row, announce in read:
            held = self.announces.get(row.device_id)
            if held is not None and announce.ts > held.ts:
                self.renewed.add(row.device_id)
            self.rows[row.device_id] = row
            self.announces[row.device_id] = announce

    def take_renewed(self) -> set[str]:
        """The devices that announced again since the last call."""
        renewed, self.renewed = self.renewed, set()
        return renewed

    def mark_failed(self, device_id: str) -> None:
        self.failed.add(device_id)
        if device_id in self.rows:
            self.rows[device_id] = self.rows[device_id].model_copy(
                update={"state": DeviceState.FAILED}
            )

    def mark_recovered(self, device_id: str) -> None:
        self.failed.discard(device_id)
        if device_id in self.rows:
            self.rows[device_id] = self.rows[device_id].model_copy(
                update={"state": DeviceState.ALIVE}
            )

    def devices(
        self,
        load: Mapping[str, int],
        reserved: Mapping[str, float],
        only: Collection[str] | None = None,
        vram: Mapping[str, float] | None = None,
    ) -> list[Device]:
        """The core's devices (all, or those of ``only``); the failed ones marked failed.
        ``reserved`` and ``vram``: the host and GPU memory deployments hold on each."""
        devices = []
        for device_id, row in self.rows.items():
            if only is not None and device_id not in only:
                continue
            device = to_device(
                row,
                self.announces[device_id],
                float(load.get(device_id, 0)),
                float(reserved.get(device_id, 0.0)),
                float((vram or {}).get(device_id, 0.0)),
            )
            if device_id in self.failed and not device.failed:
                device = replace(device, failed=True)
            devices.append(device)
        return devices

    def cluster_rates(self) -> tuple[float, float]:
        """Cluster throughput (tokens/s) and efficiency (tokens/J) from the latest samples."""
        live = self.rows.keys() - self.failed
        return cluster_rates(r.sample for d, r in self.rows.items() if d in live and r.sample)
