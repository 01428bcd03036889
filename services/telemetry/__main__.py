"""Run telemetry agents: ``python -m services.telemetry`` (a fleet, or this host)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter

from libs.devices.fleetfile import FleetSpec, build, fleet_from_file, mixed
from libs.runtime.bus import NatsBus
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.metrics import serve_metrics
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.tracing import configure_tracing, instrument
from services.telemetry.settings import TelemetrySettings

log = logging.getLogger("services.telemetry")


def fleet_spec(settings: TelemetrySettings) -> FleetSpec:
    if settings.fleet is not None:
        return fleet_from_file(settings.fleet)
    return mixed(settings.devices, settings.seed, settings.prefix)


async def main(stop: asyncio.Event, settings: TelemetrySettings) -> None:
    instrument(configure_tracing("telemetry", settings.otlp_endpoint))
    registry = CollectorRegistry()
    published = Counter(
        "tessera_telemetry_published", "Telemetry samples published", registry=registry
    )
    serve_metrics(registry, settings.metrics_port, settings.metrics_host)
    nc = await connect_nats(settings.nats_url, "telemetry", ca_file=settings.nats_ca)
    run: Callable[[asyncio.Event], Awaitable[None]]
    if settings.mode == "host":
        from libs.agents.host_agent import HostAgent
        from libs.devices.calibration import cached

        def progress(step: str, done: int, total: int) -> None:
            log.info("calibrating", extra={"step": step, "done": done, "total": total})

        calibration = await asyncio.to_thread(cached, settings.cache_dir, progress)
        log.info(
            "calibration",
            extra={
                "fp32_gflops": round(calibration.fp32_gflops, 1),
                "seconds": round(calibration.seconds, 2),
            },
        )
        run = HostAgent(NatsBus(nc), calibration, settings.interval_s).run
        devices = 1
    else:
        from libs.agents.emulated_fleet import FleetAgent

        spec = fleet_spec(settings)
        fleet = build(spec, now=time.time())  # scripted faults count from now
        run = FleetAgent(
            NatsBus(nc),
            fleet,
            settings.interval_s,
            seed=spec.seed,
            announce_every_s=settings.announce_every_s,
            published=published,
        ).run
        devices = len(fleet)
    task = asyncio.create_task(run(stop))
    announce_ready("telemetry", mode=settings.mode, devices=devices)
    await stop.wait()
    await task
    await close_nats(nc)


if __name__ == "__main__":
    settings = TelemetrySettings()
    configure_logging("telemetry", settings.log_level, settings.log_format)
    sys.exit(run_service("telemetry", lambda stop: main(stop, settings)))
