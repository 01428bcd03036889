"""Built-in fleets for the simulator (and `tessera up --fleet`): names → fleet specs."""

from __future__ import annotations

from libs.devices.fleetfile import FleetSpec, load_fleet

BUILTIN: dict[str, dict[str, object]] = {
    # The device classes Tessera was first designed for: phones, laptops, watches, workstations.
    "seed": {
        "seed": 1,
        "prefix": "seed",
        "devices": {"phone": 30, "laptop": 30, "watch": 20, "workstation": 20},
    },
    # Cloud GPU servers and edge servers (EdgeFlow's jobs).
    "cloud-edge": {"seed": 2, "prefix": "ce", "devices": {"cloud_gpu": 8, "edge_server": 16}},
    # A homogeneous GPU cluster.
    "gpu-cluster": {"seed": 3, "prefix": "gpu", "devices": {"cloud_gpu": 16}},
}


def builtin(name: str) -> FleetSpec:
    """A built-in fleet by name. Raises ``KeyError`` listing the names."""
    if name not in BUILTIN:
        raise KeyError(f"unknown fleet {name!r}; built-in: {', '.join(sorted(BUILTIN))}")
    return load_fleet(dict(BUILTIN[name]))
