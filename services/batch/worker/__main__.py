"""Run the Celery worker of the batches' requests: ``python -m services.batch.worker``.

It consumes the queue ``batch.requests`` (``services/batch/requests.py``), a thread per
request in flight (``TESSERA_BATCH_REQUEST_THREADS``, default 64), with the broker of
``TESSERA_BATCH_BROKER_URL`` and the gateway of ``TESSERA_BATCH_GATEWAY_URL``. ``tessera up``
starts it after the gateway; killed, its requests in flight are sent again by the gateway's
runner (nothing is lost, and each answer is kept once).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from celery.signals import worker_ready

from libs.contracts.batch_requests import QUEUE
from libs.runtime.lifecycle import announce_ready
from libs.runtime.logs import configure_logging
from services.batch.app import app
from services.batch.settings import BatchSettings


@worker_ready.connect  # type: ignore[untyped-decorator]
def _ready(**_: object) -> None:
    logging.getLogger().setLevel(BatchSettings().log_level)  # Celery set its own level
    announce_ready("batch-worker", queue=QUEUE)


def main() -> int:
    settings = BatchSettings()
    configure_logging("batch-worker", settings.log_level, settings.log_format)
    app.conf.worker_hijack_root_logger = False  # our log lines, as every service's
    app.worker_main(
        [
            "--quiet",  # no banner: it names the broker's URL (its password masked, still)
            "worker",
            "-Q", QUEUE,
            "-n", f"requests-{os.getpid()}@{socket.gethostname()}",
            "--pool=threads",
            f"--concurrency={settings.request_threads}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=WARNING",
        ]
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
