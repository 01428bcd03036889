"""A device agent's handlers on the in-memory bus: it follows the work and the DVFS hints sent
to its own devices, answers an announce request, and reports what it does in its samples."""

from __future__ import annotations

import numpy as np

from libs.agents.emulated_fleet import FleetAgent
from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    DVFS_HINT,
    SHARD_TASK,
    TELEMETRY,
    AnnounceRequest,
    DeviceClass,
    DvfsHint,
    shard_ring,
)
from libs.devices.emulated import EmulatedDevice
from libs.runtime.memory_bus import MemoryBus
from tests.builders import NOW


async def test_an_agent_follows_its_work_and_hints_and_announces_on_request() -> None:
    bus = MemoryBus()
    devices = [
        EmulatedDevice.draw(f"ws-{i}", DeviceClass.WORKSTATION, np.random.default_rng(i))
        for i in range(2)
    ]
    agent = FleetAgent(bus, devices, interval_s=1.0, clock=lambda: NOW)
    subs = [
        await bus.subscribe(SHARD_TASK, agent.on_work, subject=s) for s in agent._mine(SHARD_TASK)
    ] + [await bus.subscribe(DVFS_HINT, agent.on_hint, subject=s) for s in agent._mine(DVFS_HINT)]
    subs.append(await bus.subscribe(ANNOUNCE_REQUEST, agent.on_announce_request))

    [task] = shard_ring("load", "smol", "smollm2-135m-instruct", [("ws-0", 0, 30)], 1, NOW)
    await bus.publish_durable(SHARD_TASK, task, device_id="ws-0")
    hint = DvfsHint(device_id="ws-1", ts=NOW, frequency_scale=0.6, reason="idle", sleep_after_s=1.5)
    await bus.publish(DVFS_HINT, hint, device_id="ws-1")
    await bus.publish(ANNOUNCE_REQUEST, AnnounceRequest(reason="scorer started", ts=NOW))
    await bus.settle()
    await agent.tick(devices, 1.0)

    samples = {s.device_id: s for s in bus.sent(TELEMETRY)}
    assert samples["ws-0"].cpu_utilisation > samples["ws-1"].cpu_utilisation  # it works now
    assert samples["ws-1"].frequency_scale == 0.6 and samples["ws-0"].frequency_scale == 1.0
    assert devices[1].sleep_after_s == 1.5  # the mode's power policy, as the hint said
    assert {a.device_id for a in bus.sent(ANNOUNCE)} == {"ws-0", "ws-1"}
    for sub in subs:
        await sub.unsubscribe()
