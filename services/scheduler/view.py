"""The cluster as the scheduler sees it, read from the scorer's Redis keys.

Loaded once at start (one pipelined read of the live devices), then kept current by events:
a score update re-reads that one device, device-failed and device-recovered flip its state.
Nothing scans Redis per decision.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from redis.asyncio import Redis

from libs.contracts import DeviceAnnounce, DeviceClass
from libs.contracts.keys import Keys
from libs.core.model import Device

log = logging.getLogger(__name__)

#: Concurrent tasks a device of each class runs (its ``slots``).
SLOTS = {
    DeviceClass.WATCH: 1,
    DeviceClass.PHONE: 2,
    DeviceClass.LAPTOP: 4,
    DeviceClass.WORKSTATION: 8,
    DeviceClass.EDGE_SERVER: 8,
    DeviceClass.CLOUD_GPU: 32,
}
#: Idle power as a share of typical power, when the device does not report its own.
IDLE_SHARE = 0.25


def to_device(
    device_id: str,
    row: Mapping[str, str],
    raw: Mapping[str, Any],
    announce: DeviceAnnounce,
    load: float,
    reserved_gb: float,
) -> Device:
    """A core ``Device`` from the scorer's hash, its parsed ``raw`` sample and the announce."""
    caps = announce.capabilities
    total = float(raw["memory_total_gb"])
    free = max(0.0, min(float(raw["memory_available_gb"]) - reserved_gb, total))
    battery = raw.get("battery_percent")
    plugged = raw.get("plugged")
    return Device(
        device_id=device_id,
        device_class=announce.device_class,
        capability=tuple(  # type: ignore[arg-type]
            min(1.0, max(0.0, float(row[d])))
            for d in ("compute", "memory", "efficiency", "network", "stability")
        ),
        memory_total_gb=total,
        memory_free_gb=free,
        power_max_w=caps.max_power_w,
        power_now_w=min(float(raw["power_w"]), caps.max_power_w),
        power_idle_w=caps.typical_power_w * IDLE_SHARE,
        temperature_c=float(raw["temperature_c"]),
        thermal_limit_c=caps.thermal_limit_c,
        delta_t_c=caps.delta_t_c,
        # The announced speed, scaled down by the scorer when the device measures far slower.
        speed=max(caps.fp32_tflops * 1000.0 * float(row.get("speed_scale", 1.0)), 1e-3),
        slots=SLOTS[announce.device_class],
        # The busier of what this scheduler placed there and what the device reports.
        load=max(load / SLOTS[announce.device_class], float(raw.get("cpu_utilisation", 0.0))),
        battery_percent=float(battery) if battery is not None else None,
        plugged=bool(plugged) if plugged is not None else True,
        network_rtt_ms=float(raw["network_rtt_ms"]),
        network_bandwidth_mbps=float(raw["network_bandwidth_mbps"]),
        failed=row.get("state") == "failed",
    )


class ClusterView:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.rows: dict[str, dict[str, str]] = {}
        #: Each row's ``raw`` sample, parsed once when the row is read.
        self.raw: dict[str, dict[str, Any]] = {}
        self.announces: dict[str, DeviceAnnounce] = {}
        self.failed: set[str] = set()

    async def load(self) -> None:
        """Every device the scorer ranks, plus the failed ones, in one pipeline each."""
        live = [str(d) for d in await self.redis.zrange(self.keys.rank("total"), 0, -1)]
        self.failed = {str(d) for d in await self.redis.smembers(self.keys.failed)}
        await self.refresh(live + sorted(self.failed - set(live)))

    async def refresh(self, device_ids: list[str]) -> None:
        if not device_ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for device_id in device_ids:
            pipe.hgetall(self.keys.device(device_id))
            pipe.get(self.keys.caps(device_id))
        results = await pipe.execute()
        for i, device_id in enumerate(device_ids):
            row, caps = results[2 * i], results[2 * i + 1]
            if not row or "raw" not in row or "total" not in row or caps is None:
                continue
            self.rows[device_id] = row
            self.raw[device_id] = json.loads(row["raw"])
            self.announces[device_id] = DeviceAnnounce.model_validate_json(caps)

    def mark_failed(self, device_id: str) -> None:
        self.failed.add(device_id)
        if device_id in self.rows:
            self.rows[device_id] = {**self.rows[device_id], "state": "failed"}

    def mark_recovered(self, device_id: str) -> None:
        self.failed.discard(device_id)
        if device_id in self.rows:
            self.rows[device_id] = {**self.rows[device_id], "state": "alive"}

    def devices(self, load: Mapping[str, int], reserved: Mapping[str, float]) -> list[Device]:
        devices = []
        for device_id, row in self.rows.items():
            try:
                device = to_device(
                    device_id,
                    row,
                    self.raw[device_id],
                    self.announces[device_id],
                    float(load.get(device_id, 0)),
                    float(reserved.get(device_id, 0.0)),
                )
            except (KeyError, ValueError) as exc:
                log.warning(
                    "unusable device row", extra={"device_id": device_id, "error": repr(exc)}
                )
                continue
            if device_id in self.failed and not device.failed:
                device = replace(device, failed=True)
            devices.append(device)
        return devices

    def cluster_rates(self) -> tuple[float, float]:
        """Cluster throughput (tokens/s) and efficiency (tokens/J) from the latest samples."""
        tokens, watts = 0.0, 0.0
        for device_id, raw in self.raw.items():
            if device_id in self.failed:
                continue
            tokens += float(raw.get("measured_tokens_per_s") or 0.0)
            watts += float(raw.get("power_w") or 0.0)
        return tokens, (tokens / watts if watts > 0 else 0.0)
