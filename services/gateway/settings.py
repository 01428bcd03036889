"""Gateway settings (prefix ``TESSERA_GATEWAY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from libs.runtime.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_GATEWAY_", extra="ignore", populate_by_name=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    #: The scheduler's HTTP API: deployments come from it, /v1/cluster/… is proxied to it.
    #: Several replicas: their URLs separated by commas (the leader answers).
    scheduler_url: str = Field(
        "http://127.0.0.1:8100", validation_alias="TESSERA_GATEWAY_SCHEDULER_URL"
    )
    #: Bearer keys accepted on /v1/…. Keys are required unless ``auth`` is ``off``, which
    #: `tessera up` sets for a cluster on this machine; started any other way without keys,
    #: the gateway refuses to start.
    api_keys: list[str] = Field(default_factory=list)
    #: A cluster home's keys (names and digests, ``libs/runtime/api_keys.py``), read again when
    #: it changes: ``tessera keys create`` and ``revoke`` take effect without a restart.
    keys_file: Path | None = None
    auth: Literal["keys", "off"] = "keys"
    #: A JSON line per API request (its key's name, status, duration); unset: none.
    access_log: Path | None = None
    #: HTTPS: a certificate and its private key (PEM); both or neither.
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_concurrent: int = Field(32, ge=1, le=100_000)
    #: The largest file ``POST /v1/files`` takes (a batch's requests), counted as it arrives.
    files_max_bytes: int = Field(64 * 1_048_576, ge=1024)
    #: Batch requests in flight at once (at most half of ``max_concurrent``; under ``edgeflow``
    #: as many again on each edge deployment, all of them at most half); they yield to
    #: interactive requests, save those on an edge deployment (docs/batch.md).
    batch_concurrency: int = Field(8, ge=1, le=10_000)
    #: Which batches are admitted and how those requests are shared among them:
    #: ``libs/core/batch_policies.py``.
    batch_policy: Literal["edf", "fifo", "elasticflow", "edgeflow"] = "edf"
    #: The Celery broker the batches' requests go through (``python -m services.batch.worker``
    #: runs them); empty: the runner sends them through this process itself.
    batch_broker_url: SecretStr = SecretStr("")
    #: The batch runner's API key, which the batch workers send with its requests (only the
    #: serving endpoints take it); empty: one drawn at start, known to this process only.
    batch_runner_key: SecretStr = SecretStr("")
    #: Requests per second each client (API key; address with auth off) may send on average,
    #: and at once; more are refused with 429 and Retry-After.
    rate_per_s: float = Field(50.0, gt=0)
    rate_burst: int = Field(100, ge=1)
    #: Seconds without a token (and no re-placement) before a generation is given up.
    stall_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _locked(self) -> GatewaySettings:
        if self.auth == "off":
            self.api_keys, self.keys_file = [], None
        if self.auth == "keys" and not self.api_keys and self.keys_file is None:
            raise ValueError(
                "no API keys: set TESSERA_GATEWAY_API_KEYS='[\"…\"]', or "
                "TESSERA_GATEWAY_AUTH=off for a gateway only you can reach"
            )
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("HTTPS needs both TESSERA_GATEWAY_TLS_CERTFILE and _KEYFILE")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.tls_certfile else "http"
