"""A scorer told to stop exits within its bound even when Redis no longer answers: its last
flush (a device's announce waiting to be written) is dropped after ``STOP_FLUSH_S`` with a
warning, instead of waiting on a reply without limit until it is killed (seen once in CI under
load: SIGKILL after 15 s of SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from nats.aio.client import Client as NatsClient

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import ANNOUNCE, DeviceAnnounce, DeviceClass
from libs.runtime.bus import publish
from services.scorer.service import STOP_FLUSH_S
from tests.builders import make_capabilities
from tests.processes import ServiceProcess, service_env


async def test_a_scorer_whose_redis_froze_still_stops(
    nc: NatsClient, nats_server: NatsServer, uid: str
) -> None:
    frozen = RedisServer()  # its own: this test stops it dead
    with frozen:
        env = service_env(nats_server, frozen, uid, TESSERA_SCORER_FLUSH_INTERVAL_MS="5000")
        scorer = ServiceProcess("scorer", env).start()
        try:
            announce = DeviceAnnounce(
                device_id=f"{uid}-d0",
                device_class=DeviceClass.LAPTOP,
                capabilities=make_capabilities(),
                emulated=True,
                interval_s=1.0,
                ts=time.time(),
            )
            await publish(nc, ANNOUNCE, announce, device_id=announce.device_id)
            await nc.flush()
            await asyncio.sleep(0.5)  # the announce is in the scorer's buffer, not yet written
            assert frozen.process is not None
            os.kill(frozen.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            code = await asyncio.to_thread(scorer.stop, 15 + STOP_FLUSH_S)
            took = time.monotonic() - started
        finally:
            if frozen.process is not None:
                os.kill(frozen.process.pid, signal.SIGCONT)
            scorer.stop()
    # Exited by itself (0), not killed (-9); how long it took is printed, not asserted.
    print(f"the scorer stopped {took:.1f} s after SIGTERM with Redis frozen")
    assert code == 0, scorer.tail()
    said = [str(line.get("msg")) for line in scorer.lines]
    assert "last flush dropped: redis did not answer" in said, said[-10:]
