"""A fleet file's ``workers`` (``tessera up --fleet``): read with their limits, refused with
the field named when wrong, and turned into what each worker is started with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from libs.cluster.enforced import EnforcedFleet
from libs.devices.fleetfile import fleet_from_file, load_fleet

WORKERS = [
    {"id": "big", "class": "workstation", "cpus": 1.0, "memory_gb": 2},
    {"id": "small", "class": "edge_server", "cpus": 0.25, "memory_gb": 1},
]


def test_workers_are_read_beside_the_emulated_devices() -> None:
    spec = load_fleet({"devices": {"phone": 2}, "workers": WORKERS})
    assert [(w.id, w.device_class.value, w.cpus) for w in spec.workers] == [
        ("big", "workstation", 1.0),
        ("small", "edge_server", 0.25),
    ]
    assert load_fleet({"workers": WORKERS}).devices == {}  # workers alone are a fleet


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"cpus": 0}, "cpus"),
        ({"memory_gb": 0.01}, "memory_gb"),
        ({"class": "toaster"}, "class"),
        ({"id": "a b"}, "id"),
        ({"gpus": 1}, "gpus"),
        ({"link": {"rtt_ms": -1}}, "rtt_ms"),
        ({"link": {"mbit": 0}}, "mbit"),
        ({"link": {"delay": 5}}, "delay"),
    ],
)
def test_a_wrong_worker_is_refused_naming_the_field(change: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        load_fleet({"workers": [WORKERS[0] | change]})


def test_a_worker_id_given_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="worker ids given twice: big"):
        load_fleet({"workers": [WORKERS[0], WORKERS[0]]})


def test_each_worker_is_started_with_its_class_memory_and_quota(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"workers": WORKERS}))
    fleet = EnforcedFleet.read(path, "r1")
    assert fleet is not None
    assert fleet.names("llamacpp") == [("big", "llamacpp"), ("small", "llamacpp")]
    env = fleet.env("small")
    assert env["TESSERA_WORKER_DEVICE_CLASS"] == "edge_server"
    assert env["TESSERA_WORKER_MEMORY_GB"] == "1.0"
    assert "TESSERA_WORKER_CPUS" not in env and fleet.prefix("small") == []  # not enforced yet
    fleet.enforced = True  # as once its groups are made
    assert fleet.env("small")["TESSERA_WORKER_CPUS"] == "0.25"
    assert fleet.prefix("small")[:2] == ["sh", "-c"]


def test_a_fleet_file_without_workers_changes_no_worker(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"devices": {"phone": 3}}))
    assert EnforcedFleet.read(path, "r1") is None
    assert EnforcedFleet.read(None, "r1") is None


def test_a_worker_with_a_link_is_told_to_measure_its_round_trip_once_the_link_is_made(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.yaml"
    linked = WORKERS[1] | {"link": {"rtt_ms": 5, "mbit": 20}}
    path.write_text(yaml.safe_dump({"workers": [WORKERS[0], linked]}))
    fleet = EnforcedFleet.read(path, "r1")
    assert fleet is not None
    assert list(fleet.links) == ["small"]
    url = "nats://small:secret@127.0.0.1:4222"
    # no link made (start not called, or the kernel could not): the head's network, as is
    assert fleet.nats_url("small", url) == url and "TESSERA_WORKER_MEASURE_RTT" not in fleet.env(
        "small"
    )


def test_the_shipped_household_fleet_is_read_with_its_link() -> None:
    """``deploy/fleets/home.yaml``: the fleet the placement benchmark measures on."""
    path = Path(__file__).resolve().parents[3] / "deploy" / "fleets" / "home.yaml"
    fleet = EnforcedFleet.read(path, "r1")
    assert fleet is not None
    assert [(w.id, w.cpus) for w in fleet.workers.values()] == [
        ("laptop", 1.0),
        ("desktop", 0.5),
        ("nas", 0.25),
    ]
    assert list(fleet.links) == ["nas"]


HOME_TOML = """
# the household of deploy/fleets/home.yaml, in TOML
[[workers]]
id = "laptop"
class = "laptop"
cpus = 1.0
memory_gb = 1.5

[[workers]]
id = "desktop"
class = "workstation"
cpus = 0.5
memory_gb = 2.0

[[workers]]
id = "nas"
class = "edge_server"
cpus = 0.25
memory_gb = 3.0
link = {rtt_ms = 2, mbit = 100}
"""


def test_a_toml_fleet_file_is_the_same_fleet_as_its_yaml(tmp_path: Path) -> None:
    toml = tmp_path / "home.toml"
    toml.write_text(HOME_TOML)
    home = Path(__file__).parents[3] / "deploy" / "fleets" / "home.yaml"
    assert fleet_from_file(toml) == fleet_from_file(home)
    fleet = EnforcedFleet.read(toml, "t0")
    assert fleet is not None and list(fleet.links) == ["nas"]


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("f.toml", "[[workers]]\nid = ", "is not valid TOML"),
        ("f.yaml", "workers: [", "is not valid YAML"),
        ("f.yaml", "- a\n- b\n", "not a list"),
        ("f.toml", '[[workers]]\nid = "x"\nclass = "toaster"\n', "workers.0.class"),
    ],
)
def test_a_fleet_file_that_is_wrong_is_refused_naming_the_file_and_why(
    tmp_path: Path, name: str, text: str, said: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=said) as caught:
        fleet_from_file(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="No such file"):
        fleet_from_file(tmp_path / "missing.toml")
