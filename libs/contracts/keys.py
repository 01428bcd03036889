"""The Redis layout shared by the scorer (writer), the scheduler, the gateway and the CLI
(readers): key names, hash field names and the typed row each device's hash decodes to.

* ``{p}:dev:{id}``      hash: class, state, raw (the latest sample as JSON), each dimension,
                        total, scored_at, mode;
                        expires when the device stays silent.
* ``{p}:caps:{id}``     the device's announce (JSON), so a restarted scorer knows it.
* ``{p}:hist:{id}``     hash: first_seen, down_s, failures (stability history).
* ``{p}:rank:{dim}``    sorted set per dimension and ``total``: top-k in one ZREVRANGE.
* ``{p}:failed``        set of failed device ids.
* ``{p}:mode``          the active scheduling mode.
* ``{p}:weights``       the dimension weights w1–w5 the scorer uses (JSON ``DimensionWeights``;
                        the active profile's, written by the scheduler).
* ``{p}:stats``         hash of counters: processed, rejected:<reason>.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libs.contracts.base import DeviceClass, DeviceId, DeviceState, Fraction, Mode
from libs.contracts.device import TelemetrySample
from libs.contracts.errors import ContractError


@dataclass(frozen=True)
class Keys:
    prefix: str = "tessera"

    def device(self, device_id: str) -> str:
        return f"{self.prefix}:dev:{device_id}"

    def caps(self, device_id: str) -> str:
        return f"{self.prefix}:caps:{device_id}"

    def history(self, device_id: str) -> str:
        return f"{self.prefix}:hist:{device_id}"

    def rank(self, dimension: str) -> str:
        return f"{self.prefix}:rank:{dimension}"

    @property
    def failed(self) -> str:
        return f"{self.prefix}:failed"

    @property
    def mode(self) -> str:
        return f"{self.prefix}:mode"

    @property
    def weights(self) -> str:
        return f"{self.prefix}:weights"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats"


#: The scores a device's hash holds: the five dimensions and their weighted total, in [0, 1].
SCORE_FIELDS = ("compute", "memory", "efficiency", "network", "stability", "total")


class DeviceField(StrEnum):
    """The other fields of a device's hash (``Keys.device``)."""

    CLASS = "class"
    STATE = "state"
    #: The latest validated ``TelemetrySample``, as its JSON bytes.
    SAMPLE = "raw"
    SCORED_AT = "scored_at"
    MODE = "mode"
    #: Announced speed × this = the speed the scheduler plans with (``libs/core/honesty.py``).
    SPEED_SCALE = "speed_scale"


class StatsField(StrEnum):
    """Fields of ``Keys.stats`` (also ``rejected:<reason>`` counters)."""

    SINCE = "since"
    PROCESSED = "processed"


class DeviceRow(BaseModel):
    """One device's hash, decoded once: what the scorer wrote about it.

    A device the scorer has sampled but not yet scored has ``sample`` and no scores; one it
    scored has both. ``decode`` raises ``ContractError`` for a hash it cannot read.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    device_id: DeviceId
    device_class: DeviceClass | None = None
    state: DeviceState = DeviceState.ALIVE
    sample: TelemetrySample | None = None
    compute: Fraction | None = None
    memory: Fraction | None = None
    efficiency: Fraction | None = None
    network: Fraction | None = None
    stability: Fraction | None = None
    total: Fraction | None = None
    scored_at: float | None = None
    mode: Mode | None = None
    speed_scale: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0

    @property
    def scored(self) -> bool:
        return self.total is not None and self.sample is not None

    @property
    def dimensions(self) -> tuple[float, float, float, float, float]:
        """The five dimension scores (0 where not scored yet)."""
        c, m, e, n, s = (self.compute, self.memory, self.efficiency, self.network, self.stability)
        return (c or 0.0, m or 0.0, e or 0.0, n or 0.0, s or 0.0)

    @classmethod
    def decode(cls, device_id: str, fields: Mapping[str, str]) -> DeviceRow:
        try:
            sample = fields.get(DeviceField.SAMPLE)
            return cls(
                device_id=device_id,
                device_class=fields.get(DeviceField.CLASS),
                state=fields.get(DeviceField.STATE, DeviceState.ALIVE),
                sample=TelemetrySample.model_validate_json(sample) if sample else None,
                scored_at=fields.get(DeviceField.SCORED_AT),
                mode=fields.get(DeviceField.MODE),
                speed_scale=fields.get(DeviceField.SPEED_SCALE, 1.0),
                **{name: fields[name] for name in SCORE_FIELDS if name in fields},
            )
        except ValidationError as exc:
            raise ContractError("invalid", f"device row {device_id}: {exc}") from None


def scored_fields(
    scores: Mapping[str, float],
    device_class: DeviceClass,
    now: float,
    mode: Mode,
    speed_scale: float,
) -> dict[str, str | float]:
    """What the scorer writes to a device's hash when it scores it (``DeviceRow`` reads it)."""
    return {
        **{name: float(scores[name]) for name in SCORE_FIELDS},
        DeviceField.CLASS: device_class.value,
        DeviceField.STATE: DeviceState.ALIVE.value,
        DeviceField.SCORED_AT: now,
        DeviceField.MODE: mode.value,
        DeviceField.SPEED_SCALE: speed_scale,
    }
