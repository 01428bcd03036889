"""Run the scorer: ``python -m services.scorer``."""

from __future__ import annotations

import asyncio
import sys

from libs.runtime.bus import NatsBus
from libs.runtime.connections import connected
from libs.runtime.lifecycle import announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.metrics import serve_metrics
from libs.runtime.tracing import configure_tracing, instrument
from services.scorer.metrics import ScorerMetrics
from services.scorer.service import Scorer
from services.scorer.settings import ScorerSettings


async def main(stop: asyncio.Event, settings: ScorerSettings) -> None:
    instrument(configure_tracing("scorer", settings.otlp_endpoint))
    metrics = ScorerMetrics.create()
    port = serve_metrics(metrics.registry, settings.metrics_port, settings.metrics_host)
    async with connected(settings, "scorer") as (nc, redis):
        scorer = Scorer(settings, NatsBus(nc), redis, metrics, connected=lambda: nc.is_connected)
        await scorer.start()
        await nc.flush()  # the server holds our subscriptions before we say ready
        announce_ready("scorer", metrics_port=port)
        await stop.wait()
        await scorer.stop()


if __name__ == "__main__":
    settings = ScorerSettings()
    configure_logging("scorer", settings.log_level, settings.log_format)
    sys.exit(run_service("scorer", lambda stop: main(stop, settings)))
