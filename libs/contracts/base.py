"""Base wire model and the token types shared by every contract.

Every message on the wire is a frozen pydantic model that forbids unknown fields and rejects
NaN/infinity, so a malformed message fails at the edge with an error naming the field.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

#: Subject-safe identifier: letters, digits, ``_`` and ``-`` (no dots or wildcards), 1–64 chars.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

DeviceId = Annotated[str, StringConstraints(pattern=TOKEN_PATTERN)]
RequestId = Annotated[str, StringConstraints(pattern=TOKEN_PATTERN)]
DeploymentId = Annotated[str, StringConstraints(pattern=TOKEN_PATTERN)]
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$")]
#: host:port (an IPv4 address or a host name) where a device serves something to its peers.
Endpoint = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,253}:[0-9]{1,5}$")]
#: How a CPU shard holds its weights: int8 (one scale per output row), bfloat16 or float32.
Precision = Literal["int8", "bfloat16", "float32"]

#: Unix time in seconds. Bounded so that a garbage timestamp is refused, not stored.
Timestamp = Annotated[float, Field(ge=0.0, le=1e11)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
#: Physically possible temperatures for a device that still reports (°C).
TemperatureC = Annotated[float, Field(ge=-60.0, le=200.0)]
#: Tokens of context a request may use (prompt and completion) where nothing says otherwise:
#: a deployment's context when neither it nor its model names a shorter one, the engines'
#: context when they are given none.
DEFAULT_CONTEXT_TOKENS = 2048


class WireModel(BaseModel):
    """Frozen, closed, finite: the base of every message."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class DeviceClass(StrEnum):
    PHONE = "phone"
    LAPTOP = "laptop"
    WATCH = "watch"
    WORKSTATION = "workstation"
    EDGE_SERVER = "edge_server"
    CLOUD_GPU = "cloud_gpu"

    @property
    def is_mobile(self) -> bool:
        """Mobile classes throttle at 85 °C, the others at 95 °C."""
        return self in (DeviceClass.PHONE, DeviceClass.WATCH, DeviceClass.LAPTOP)


class MemoryType(StrEnum):
    LPDDR4 = "lpddr4"
    DDR4 = "ddr4"
    DDR5 = "ddr5"
    LPDDR5 = "lpddr5"
    GDDR6 = "gddr6"
    HBM = "hbm"


class Mode(StrEnum):
    """Scheduling modes: what DWPS weighs up (performance: urgency and complexity; energy:
    efficiency; balanced: neither)."""

    PERFORMANCE = "performance"
    ENERGY = "energy"
    BALANCED = "balanced"


class DeviceState(StrEnum):
    ALIVE = "alive"
    FAILED = "failed"
