"""Gateway settings (prefix ``TESSERA_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field
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
    #: Bearer keys accepted on /v1/…; empty (the default, for local use) turns checking off.
    api_keys: list[str] = Field(default_factory=list)
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_concurrent: int = Field(32, ge=1, le=100_000)
    #: Seconds without a token (and no re-placement) before a generation is given up.
    stall_s: float = Field(60.0, gt=0)
