"""``tessera service install``: a systemd unit that starts the cluster at boot, as systemd
itself checks it (``systemd-analyze verify``), and a joined host's unit that keeps its token
private."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from libs.cli.main import app


def verify(unit: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze on this machine")
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_cluster_s_unit_runs_tessera_up_on_its_home_and_restarts_it(tmp_path: Path) -> None:
    unit = tmp_path / "tessera.service"
    home = tmp_path / "home"
    result = CliRunner().invoke(
        app,
        ["service", "install", "--path", str(unit), "--home", str(home), "--args", "--workers 3"],
    )
    assert result.exit_code == 0, result.output
    text = unit.read_text()
    assert f"tessera up --home {home} --workers 3" in text
    assert "Restart=on-failure" in text and "WantedBy=" in text
    assert "enable --now tessera" in result.output
    verify(unit)


def test_a_joined_host_s_unit_holds_its_token_readable_by_its_owner_only(tmp_path: Path) -> None:
    unit = tmp_path / "tessera-join.service"
    result = CliRunner().invoke(
        app,
        ["service", "install", "--path", str(unit), "--join", "nats://10.0.0.2:4222"],
        env={"TESSERA_JOIN_TOKEN": "secret-token-123"},
    )
    assert result.exit_code == 0, result.output
    text = unit.read_text()
    assert "tessera join nats://10.0.0.2:4222" in text
    assert 'Environment="TESSERA_JOIN_TOKEN=secret-token-123"' in text
    assert unit.stat().st_mode & 0o777 == 0o600
    verify(unit)
    missing = CliRunner().invoke(
        app,
        ["service", "install", "--path", str(unit), "--join", "nats://10.0.0.2:4222"],
        env={"TESSERA_JOIN_TOKEN": ""},
    )
    assert missing.exit_code == 2 and "join token" in missing.output
