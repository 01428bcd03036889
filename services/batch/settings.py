"""Batch settings (prefix ``TESSERA_BATCH_``)."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from libs.runtime.settings import ServiceSettings


class BatchSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_BATCH_", extra="ignore", populate_by_name=True
    )

    #: The Celery broker and result backend (Redis).
    broker_url: str = "redis://127.0.0.1:6379/1"
    #: Shared storage every worker reads and writes checkpoints in.
    checkpoint_dir: Path = Path.home() / ".cache" / "tessera" / "checkpoints"
    #: An unacknowledged job (its worker died) is handed out again after this long. A job still
    #: running then is handed out twice; the second copy resumes from the checkpoint, or stops.
    visibility_timeout_s: float = Field(3600.0, gt=0)
    #: How long the dispatcher remembers a job after its last placement (s).
    job_ttl_s: float = Field(86_400.0, gt=0)
    #: Where the batches' requests are sent (the gateway's serving path), with the gateway's
    #: batch runner key (``TESSERA_GATEWAY_BATCH_RUNNER_KEY``), and how long one may take (s).
    gateway_url: str = "http://127.0.0.1:8000"
    gateway_key: SecretStr = SecretStr("")
    request_timeout_s: float = Field(3600.0, gt=0)
    #: The batches' requests one worker sends at once (a thread each; at least the gateway's
    #: batch requests at once, half its ``max_concurrent``, or requests wait in the queue).
    request_threads: int = Field(64, ge=1, le=1024)
    #: The device the worker's training runs are reported on (its host by default).
    device_id: str = Field(default_factory=socket.gethostname, min_length=1)
