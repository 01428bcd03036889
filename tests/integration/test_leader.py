"""Scheduler replicas elect one leader through a lease in a real NATS KV bucket: the other
takes over when the leader stops renewing, and at no moment do two replicas lead."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsClient

from services.scheduler.leader import Lease
from tests.waiting import wait_until


async def test_one_leader_then_the_follower_takes_over_never_two(nc: NatsClient, uid: str) -> None:
    first = Lease(nc, "a", key=f"lead-{uid}", ttl_s=1.5)
    second = Lease(nc, "b", key=f"lead-{uid}", ttl_s=1.5)
    assert await first.try_acquire()
    assert not await second.try_acquire()
    stop, lost = asyncio.Event(), asyncio.Event()
    holding = asyncio.create_task(first.hold(lost, stop))
    following = asyncio.create_task(second.acquire(asyncio.Event()))
    overlaps = 0

    async def watch() -> None:
        nonlocal overlaps
        while not following.done():
            overlaps += first.valid and second.valid
            await asyncio.sleep(0.01)

    watching = asyncio.create_task(watch())
    renewed = first.revision
    await wait_until(lambda: first.revision >= renewed + 2 or lost.is_set(), timeout_s=30)
    if not lost.is_set():  # (a machine too busy to renew in time loses the lease: allowed)
        assert not following.done()  # the leader renews: the follower waits
    stop.set()  # the leader stops renewing, as a killed one would
    await holding
    assert await asyncio.wait_for(following, 10)
    await watching
    assert overlaps == 0
    assert second.valid and not first.valid
    # The old leader, renewing late, finds the lease taken and steps down.
    assert not await first.renew() and not first.valid


async def test_a_clean_stop_hands_over_at_once(nc: NatsClient, uid: str) -> None:
    first = Lease(nc, "a", key=f"hand-{uid}", ttl_s=5.0)
    second = Lease(nc, "b", key=f"hand-{uid}", ttl_s=5.0)
    assert await first.try_acquire()
    await first.release()
    assert await second.try_acquire()


async def test_a_lease_that_expired_unseen_is_taken_again_unless_another_took_it(
    nc: NatsClient, uid: str
) -> None:
    """NATS out of reach longer than the lease (a restart): the lease expires with nobody
    writing it, and its leader takes it again instead of stepping down; once another replica
    took it meanwhile, the old leader steps down."""
    first = Lease(nc, "a", key=f"away-{uid}", ttl_s=1.5)
    assert await first.try_acquire()
    await asyncio.sleep(2.5)  # expired: nobody renewed it, nobody took it
    assert await first.renew() and first.valid
    await asyncio.sleep(2.5)
    second = Lease(nc, "b", key=f"away-{uid}", ttl_s=1.5)
    assert await second.try_acquire()  # expired again: the other replica leads now
    assert not await first.renew() and not first.valid
