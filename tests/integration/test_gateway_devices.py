"""The gateway reads the fleet from Redis under the cluster's key prefix, like every other
service: a cluster that is not under the default prefix still lists its devices."""

from __future__ import annotations

import httpx

from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts.keys import DeviceRow
from libs.runtime.procs import free_port
from tests.processes import GATEWAY_STOPPED, ServiceProcess, service_env
from tests.waiting import wait_until_async


async def test_cluster_devices_lists_the_devices_under_the_clusters_key_prefix(
    nats_server: NatsServer, redis_server: RedisServer, scorer: ServiceProcess, uid: str
) -> None:
    env = service_env(nats_server, redis_server, uid)
    fleet = ServiceProcess(
        "telemetry", {**env, "TESSERA_TELEMETRY_DEVICES": "3", "TESSERA_TELEMETRY_PREFIX": uid}
    ).start()
    port = free_port()
    gateway = ServiceProcess(
        "gateway",
        {
            **env,
            "TESSERA_GATEWAY_PORT": str(port),
            "TESSERA_GATEWAY_SCHEDULER_URL": f"http://127.0.0.1:{free_port()}",  # none there
            "TESSERA_GATEWAY_AUTH": "off",
        },
    ).start()
    rows: list[DeviceRow] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def listed() -> bool:
                answer = await client.get("/v1/cluster/devices")
                assert answer.status_code == 200
                listed = answer.json()
                assert all(r["capabilities"]["memory_total_gb"] > 0 for r in listed)
                # where each reading comes from: the emulated fleet's are all its classes'
                assert all(set(r["sources"].values()) == {"emulated"} for r in listed), listed
                added = ("capabilities", "sources")  # beside the scorer's row
                rows[:] = [
                    DeviceRow.model_validate({k: v for k, v in r.items() if k not in added})
                    for r in listed
                ]
                return len(rows) == 3

            await wait_until_async(listed, timeout_s=60)
        assert all(r.device_id.startswith(uid) and r.scored for r in rows)
        totals = [r.total for r in rows]
        assert totals == sorted(totals, reverse=True)  # best first
    finally:
        assert gateway.stop() in GATEWAY_STOPPED
        fleet.stop()
