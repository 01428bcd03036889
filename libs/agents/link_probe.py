"""What a device measures of its link to the cluster, as a real host's agent and a fleet's
linked worker both do: the round trip to NATS (a flush) and the bandwidth towards it (a burst
of bytes on the device's own probe subject, which nobody reads, timed to the server's answer
of the flush after it, less one round trip)."""

from __future__ import annotations

import logging
import time

from libs.contracts.channels import PROBE
from libs.devices.emulated import EmulatedDevice
from libs.runtime.bus import Bus

log = logging.getLogger(__name__)

#: The burst: 1 MiB in 64 KiB messages (0.2 s at 40 Mbit/s); how often it is sent again.
BURST_BYTES, CHUNK_BYTES = 1 << 20, 64 << 10
BANDWIDTH_EVERY_S = 600.0


async def round_trip_ms(bus: Bus) -> float:
    """This process's round trip to NATS now (ms): a flush, measured."""
    started = time.perf_counter()
    await bus.flush(timeout_s=5)
    return (time.perf_counter() - started) * 1000.0


async def bandwidth_mbps(bus: Bus, device_id: str, burst_bytes: int = BURST_BYTES) -> float:
    """Megabits per second from this process to NATS now: ``burst_bytes`` on ``device_id``'s
    probe subject, until the server has read them all (a flush), less one round trip. The
    flush must follow the burst on the wire, as ``OrderedClient``'s does (every connection
    ``connect_nats`` makes): nats-py's own sends its ping ahead of what it holds queued."""
    rtt_s = await round_trip_ms(bus) / 1000.0
    subject = PROBE.subject(device_id=device_id)
    chunk = bytes(CHUNK_BYTES)
    sent, started = 0, time.perf_counter()
    while sent < burst_bytes:
        await bus.publish_bytes(subject, chunk)
        sent += len(chunk)
    await bus.flush(timeout_s=60)
    seconds = max(time.perf_counter() - started - rtt_s, 1e-6)
    return sent * 8 / seconds / 1e6


async def measure_bandwidth(bus: Bus, device: EmulatedDevice) -> bool:
    """``device``'s bandwidth to NATS measured into what it announces (``bandwidth_mbps``);
    False where the measurement failed (NATS away or slow: the figure it had is kept)."""
    try:
        mbps = round(await bandwidth_mbps(bus, device.device_id), 1)
    except Exception as exc:  # measured again later
        log.warning("bandwidth not measured", extra={"reason": repr(exc)})
        return False
    update = {"network_bandwidth_mbps": mbps}
    device.capabilities = device.capabilities.model_copy(update=update)
    return True
