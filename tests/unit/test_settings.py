"""Shared settings use one name everywhere; each service's own values carry its prefix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from libs.cli.main import app
from services.gateway.settings import GatewaySettings


def test_shared_and_prefixed_values_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TESSERA_NATS_URL", "nats://10.0.0.1:4333")
    monkeypatch.setenv("TESSERA_GATEWAY_PORT", "9001")
    monkeypatch.setenv("TESSERA_GATEWAY_API_KEYS", '["k1"]')
    settings = GatewaySettings()
    assert settings.nats_url == "nats://10.0.0.1:4333"
    assert settings.port == 9001


def test_bad_values_are_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_GATEWAY_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        GatewaySettings()


def test_the_gateway_will_not_start_open_unless_told_to() -> None:
    with pytest.raises(ValidationError, match="no API keys"):
        GatewaySettings()  # keys are required by default: nobody gets in unasked
    assert GatewaySettings(api_keys=["k1"]).auth == "keys"
    assert GatewaySettings(auth="off").api_keys == []  # what `tessera up` runs locally
    with pytest.raises(ValidationError, match="both"):
        GatewaySettings(auth="off", tls_certfile="/tmp/cert.pem")


def test_tessera_up_refuses_half_a_tls_setting_saying_what_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TESSERA_NATS_CA", "/tmp/ca.pem")  # no certificate or key for NATS
    result = CliRunner().invoke(app, ["up", "--devices", "0"])
    assert result.exit_code == 2
    assert "TESSERA_NATS_TLS_CERT, TESSERA_NATS_TLS_KEY and TESSERA_NATS_CA together" in (
        result.output
    )
