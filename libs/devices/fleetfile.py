"""Fleet files: how many devices of each class, a seed, and scripted faults; YAML (below) or
the same keys in TOML (a file named ``*.toml``: ``[[workers]]`` tables, ``link = {rtt_ms = 2,
mbit = 100}``).

seed: 7
prefix: home          # device ids are <prefix>-<class>-<n>
devices: {phone: 3, laptop: 2, watch: 2, workstation: 1}
faults:
  - {device: home-phone-0, kind: drop_out, at_s: 30, duration_s: 20}
  - {device: home-laptop-1, kind: overheat, at_s: 10, amount: 40}
workers:      # `tessera up --fleet`: workers the kernel holds to a device's CPU and memory
  - {id: big, class: workstation, cpus: 1.0, memory_gb: 2}
  - {id: small, class: edge_server, cpus: 0.25, memory_gb: 1}
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from libs.contracts import DeviceClass
from libs.devices.emulated import EmulatedDevice, Fault, FaultKind

#: The default mixed fleet of `tessera up`, in the order devices are added.
MIXED_ORDER = (
    DeviceClass.LAPTOP,
    DeviceClass.PHONE,
    DeviceClass.WORKSTATION,
    DeviceClass.WATCH,
    DeviceClass.EDGE_SERVER,
    DeviceClass.PHONE,
    DeviceClass.LAPTOP,
    DeviceClass.CLOUD_GPU,
)


class FaultSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    kind: FaultKind
    at_s: Annotated[float, Field(ge=0)]
    duration_s: Annotated[float, Field(gt=0)] = float("inf")
    amount: float = 0.0


class LinkSpec(BaseModel):
    """A worker's link to the head: the round trip it adds and its bandwidth each way."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rtt_ms: Annotated[float, Field(ge=0.0, le=2000.0)] = 0.0
    mbit: Annotated[float, Field(ge=0.1, le=100_000.0)] = 1000.0


class WorkerSpec(BaseModel):
    """A worker of ``tessera up --fleet`` that the kernel holds to its device's size: ``cpus``
    cores' worth of CPU time and ``memory_gb`` of memory (``libs/cluster/limits.py``); its
    speed is what it measures inside them."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,40}$")]
    device_class: DeviceClass = Field(alias="class")
    cpus: Annotated[float, Field(ge=0.05, le=64)]
    memory_gb: Annotated[float, Field(ge=0.1, le=4096)]
    #: Its own network namespace, joined to the head by this link (None: the head's network).
    link: LinkSpec | None = None


class FleetSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    seed: int = 0
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]{0,24}$")] = "dev"
    devices: dict[DeviceClass, Annotated[int, Field(ge=0, le=100_000)]] = Field(
        default_factory=dict
    )
    #: Utilisation every device starts with (work the cluster already runs), in [0, 1].
    background_load: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    faults: tuple[FaultSpec, ...] = ()
    #: Workers under OS-enforced limits (``tessera up --fleet``), beside the emulated devices.
    workers: tuple[WorkerSpec, ...] = ()

    @model_validator(mode="after")
    def _faults_name_devices(self) -> FleetSpec:
        names = [w.id for w in self.workers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"worker ids given twice: {', '.join(twice)}")
        if sum(w.link is not None for w in self.workers) > 64:
            raise ValueError("at most 64 workers may have a link")
        ids = set(device_ids(self)) | {"*"}
        unknown = [f.device for f in self.faults if f.device not in ids]
        if unknown:
            raise ValueError(f"faults name unknown devices: {', '.join(unknown[:5])}")
        return self


def mixed(count: int, seed: int = 0, prefix: str = "dev") -> FleetSpec:
    """``count`` devices cycling through the classes of ``MIXED_ORDER``."""
    counts: dict[DeviceClass, int] = {}
    for i in range(count):
        cls = MIXED_ORDER[i % len(MIXED_ORDER)]
        counts[cls] = counts.get(cls, 0) + 1
    return FleetSpec(seed=seed, prefix=prefix, devices=counts)


def load_fleet(data: dict[str, Any]) -> FleetSpec:
    """Validate a parsed fleet file. Raises ``pydantic.ValidationError`` naming the field."""
    return FleetSpec.model_validate(data)


def fleet_from_file(path: Path) -> FleetSpec:
    """The fleet a file describes (``read_fleet_file``, then ``load_fleet``). Raises
    ``ValueError`` naming the file and each field that is wrong, in one line each."""
    data = read_fleet_file(path)
    try:
        return load_fleet(data)
    except ValidationError as exc:
        wrong = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'the file'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ValueError(f"fleet file {path}: {wrong}") from None


def read_fleet_file(path: Path) -> dict[str, Any]:
    """A fleet file's keys: TOML where its name ends ``.toml``, else YAML (JSON is YAML too).
    Raises ``ValueError`` naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"fleet file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "YAML"
        said = " ".join(str(exc).split())  # YAML's message spans lines
        raise ValueError(f"fleet file {path} is not valid {kind}: {said}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"fleet file {path}: expected keys (workers, devices, …), not a list")
    return data


def device_ids(spec: FleetSpec) -> list[str]:
    sep = "-" if spec.prefix else ""
    return [
        f"{spec.prefix}{sep}{cls.value.replace('_', '')}-{i}"
        for cls, count in spec.devices.items()
        for i in range(count)
    ]


def build(spec: FleetSpec, now: float = 0.0) -> list[EmulatedDevice]:
    """The devices of ``spec``; the same spec always gives the same figures."""
    rng = np.random.default_rng(spec.seed)
    classes = [cls for cls, count in spec.devices.items() for _ in range(count)]
    faults: dict[str, list[Fault]] = {}
    for f in spec.faults:
        faults.setdefault(f.device, []).append(Fault(f.kind, f.at_s, f.duration_s, f.amount))
    devices = []
    for device_id, cls in zip(device_ids(spec), classes, strict=True):
        device = EmulatedDevice.draw(device_id, cls, rng, now)
        device.faults = tuple(faults.get(device_id, []) + faults.get("*", []))
        if spec.background_load > 0:
            device.assign("background", spec.background_load)
        devices.append(device)
    return devices
