"""A scheduler that took up a checkpoint meets the cluster as it is now (``reconcile``).

Devices gone since the checkpoint count as failed (their plans move). Every device is asked to
announce again, and each restored plan's load tasks go out once every device of its route has
(``DeploymentLog.resend``): after a whole cluster's restart its workers listen at new addresses
(llama.cpp's RPC servers), which the checkpoint's announces do not hold. A scheduler restarted
alone finds its devices announcing at once, and sends at once. Workers answer the tasks with
their reports, which may have been lost while no scheduler led.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from libs.contracts import ANNOUNCE_REQUEST, AnnounceRequest
from libs.runtime.bus import Bus
from libs.runtime.lifecycle import Background
from services.scheduler.deployment_log import DeploymentLog
from services.scheduler.loop import CommandLoop
from services.scheduler.view import ClusterView

#: How often restored plans waiting for their devices are looked at; how much older than the
#: restart an announce may be and still count (clocks of one host, a message in flight).
RESEND_EVERY_S, ANNOUNCE_SLACK_S = 0.5, 1.0


async def reconcile(
    view: ClusterView,
    log: DeploymentLog,
    loop: CommandLoop,
    bus: Bus,
    background: Background,
    fail: Callable[[str], Awaitable[None]],
    clock: Callable[[], float],
    wait_s: float,
) -> None:
    """``fail``: a device's failure, as a command; ``wait_s``: how long a restored plan waits
    for its devices to announce."""
    gone = {
        device
        for deployment in log.book
        for device in deployment.route
        if device not in view.rows or device in view.failed
    }
    for device_id in sorted(gone):
        loop.post(functools.partial(fail, device_id), "reconcile")
    epochs = {d.deployment_id: d.epoch for d in log.book}
    started = clock()
    await bus.publish(ANNOUNCE_REQUEST, AnnounceRequest(reason="scheduler started", ts=started))

    def announced(device_id: str) -> bool:
        announce = view.announces.get(device_id)
        return announce is not None and announce.ts >= started - ANNOUNCE_SLACK_S

    async def resume() -> None:
        now = clock()
        log.deployer.restored(log.book, now)
        log.await_devices(epochs, now + wait_s)
        await log.resend(now, announced)
        await log.publish_snapshot(now)

    async def resend_waiting() -> None:
        if log.waiting:  # nothing to do once every restored plan went out
            await loop.call(lambda: log.resend(clock(), announced), "resend")

    loop.post(resume, "resume")
    background.every(RESEND_EVERY_S, resend_waiting)
