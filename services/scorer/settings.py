"""Scorer settings (prefix ``TESSERA_SCORER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.runtime.settings import ServiceSettings


class ScorerSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_SCORER_", extra="ignore", populate_by_name=True
    )

    #: Re-score a stable device at least this often (s).
    rescore_interval_s: float = Field(30.0, gt=0, le=3600)
    #: A device is failed after this many announced intervals without a telemetry sample (its
    #: heartbeat).
    heartbeat_misses: int = Field(3, ge=1, le=100)
    flush_interval_ms: int = Field(50, ge=1, le=5000)
    detector_interval_s: float = Field(0.25, gt=0, le=10)
    #: The memory need the device part of MBS is measured against (GB).
    reference_need_gb: float = Field(2.0, gt=0)
    model_type: Literal["float", "quantised", "balanced"] = "balanced"
    # Significant changes that trigger an immediate re-score:
    memory_change: float = Field(0.10, ge=0, description="fraction of available memory")
    temperature_change_c: float = Field(5.0, ge=0)
    battery_change_points: float = Field(5.0, ge=0)
    rtt_change: float = Field(0.5, ge=0, description="fraction of the round trip")
    utilisation_change: float = Field(0.2, ge=0)
    unknown_device_cache_s: float = Field(10.0, ge=0)
