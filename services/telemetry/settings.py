"""Telemetry settings (prefix ``TESSERA_TELEMETRY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.runtime.settings import ServiceSettings


class TelemetrySettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_TELEMETRY_", extra="ignore", populate_by_name=True
    )

    #: ``fleet``: N emulated devices in this process; ``host``: this machine, probed for real.
    mode: Literal["fleet", "host"] = "fleet"
    devices: int = Field(6, ge=0, le=100_000)
    fleet: Path | None = None
    seed: int = 0
    prefix: str = Field("dev", pattern=r"^[A-Za-z0-9_]{0,24}$")
    interval_s: float = Field(5.0, ge=1.0, le=10.0)
    #: Re-announce every this many seconds, so a restarted scorer learns devices at once.
    announce_every_s: float = Field(60.0, gt=0)
    #: Where the host calibration is cached (one file per host).
    cache_dir: Path = Path.home() / ".cache" / "tessera"
