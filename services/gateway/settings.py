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
