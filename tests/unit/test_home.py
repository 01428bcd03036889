"""A cluster's home (``libs/cluster/home.py``), its keys (``libs/runtime/api_keys.py``) and the
LAN's lock (``lan_exposure``): what a user meets when a home is new, newer, damaged, someone
else's or in use, and when a gateway would face the LAN with no key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libs.cluster.access import AccessControl
from libs.cluster.home import VERSION, Home, HomeRefused, open_home
from libs.cluster.up_options import StartRefused, lan_exposure
from libs.runtime.api_keys import create_key, digest, read_keys, revoke_key
from libs.runtime.settings import default_home
from services.gateway.core.keyring import KeyRing


def test_the_home_is_the_flag_then_tessera_home_then_xdg() -> None:
    assert default_home({"TESSERA_HOME": "/srv/t"}) == Path("/srv/t")
    assert default_home({"XDG_DATA_HOME": "/d"}) == Path("/d/tessera/default")
    assert default_home({}) == Path.home() / ".local/share/tessera/default"


def test_a_new_home_is_made_private_and_versioned(tmp_path: Path) -> None:
    home, lock, said = open_home(tmp_path / "h")
    os.close(lock)
    assert said == [f"new home {home.path}"]
    assert home.version_file.read_text().strip() == str(VERSION)
    assert home.path.stat().st_mode & 0o777 == 0o700


def test_a_home_of_a_newer_layout_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.version_file.write_text(f"{VERSION + 1}\n")
    (tmp_path / "access.json").write_text("{}")
    with pytest.raises(HomeRefused, match="written by a newer Tessera") as refused:
        home.prepare()
    assert "Nothing in it was changed" in str(refused.value)
    assert home.version_file.read_text() == f"{VERSION + 1}\n"
    assert (tmp_path / "access.json").read_text() == "{}"


def test_a_folder_that_is_no_home_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(HomeRefused, match="not a Tessera home"):
        Home(tmp_path).prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_home_owned_by_another_user_is_refused_naming_them(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(tmp_path, 65534, 65534)
    with pytest.raises(HomeRefused, match="belongs to nobody"):
        open_home(tmp_path)


def test_a_second_holder_of_a_home_is_refused_naming_the_first(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from libs.cluster.home import Home;"
        f"Home(Path({str(tmp_path)!r})).lock(); print('held', flush=True); time.sleep(30)"
    )
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        with pytest.raises(HomeRefused, match=rf"another `tessera up` \(pid {first.pid}\)"):
            Home(tmp_path).lock()
    finally:
        first.kill()
        first.wait()
    os.close(Home(tmp_path).lock())  # the kernel dropped the dead holder's lock


def test_fresh_says_what_it_deletes_and_keeps_nothing(tmp_path: Path) -> None:
    home, lock, _ = open_home(tmp_path)
    AccessControl(["worker-0"], path=home.access_file)
    create_key(home.keys_file, "laptop")
    os.close(lock)
    home, lock, said = open_home(tmp_path, fresh=True)
    os.close(lock)
    assert any("join token" in line for line in said)
    assert any("API keys" in line for line in said)
    assert not home.access_file.exists() and not home.keys_file.exists()


def test_the_users_and_the_token_survive_a_restart_and_a_revocation_is_kept(
    tmp_path: Path,
) -> None:
    path = tmp_path / "access.json"
    first = AccessControl(["worker-0"], path=path)
    first.admit_joined("laptop", "p" * 20)
    second = AccessControl(["worker-0"], path=path)
    assert second.token == first.token and second.passwords == first.passwords
    assert second.joined == ["laptop"] and "laptop" in second.devices
    second.revoke("laptop")
    third = AccessControl(["worker-0"], path=path)
    assert "laptop" not in third.passwords and third.joined == []
    assert path.stat().st_mode & 0o777 == 0o600


def test_keys_are_stored_hashed_and_a_revoked_one_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key = create_key(path, "laptop")
    assert key not in path.read_text()  # only its digest is written
    assert [k.sha256 for k in read_keys(path)] == [digest(key)]
    with pytest.raises(ValueError, match="exists"):
        create_key(path, "laptop")
    with pytest.raises(ValueError, match="a key's name"):
        create_key(path, "no spaces please")
    ring = KeyRing([], path)
    assert ring.name_of(key) == "laptop" and ring.name_of("tsk-guess") is None
    assert revoke_key(path, "laptop") and not revoke_key(path, "laptop")
    ring._checked = 0.0  # the next request looks at the file again
    assert ring.name_of(key) is None
    assert json.loads(path.read_text()) == {"keys": []}


def test_a_gateway_facing_the_lan_needs_a_key_or_open_said_at_start() -> None:
    assert lan_exposure("127.0.0.1", has_keys=False, open_lan=False) is None
    assert lan_exposure("0.0.0.0", has_keys=True, open_lan=False) is None
    with pytest.raises(StartRefused, match="--open"):
        lan_exposure("0.0.0.0", has_keys=False, open_lan=False)
    warning = lan_exposure("192.168.1.20", has_keys=False, open_lan=True)
    assert warning is not None and warning.startswith("WARNING")


def test_a_joined_host_is_revoked_on_the_home_while_no_cluster_runs(tmp_path: Path) -> None:
    """`tessera revoke` with the head stopped: the device leaves the home's users (refused from
    the next start); an unknown device, or a home in use, is refused, naming why."""
    from typer.testing import CliRunner

    from libs.cli.main import app

    home = tmp_path / "home"
    _, lock, _ = open_home(home)
    AccessControl(["worker-0"], path=home / "access.json").admit_joined("laptop", "p" * 20)
    env = {"TESSERA_RUN_FILE": str(tmp_path / "none.json")}  # no cluster runs
    in_use = CliRunner().invoke(app, ["revoke", "laptop", "--home", str(home)], env=env)
    assert in_use.exit_code == 2 and "another `tessera up`" in in_use.output
    os.close(lock)
    unknown = CliRunner().invoke(app, ["revoke", "phone", "--home", str(home)], env=env)
    assert unknown.exit_code == 1 and "joined: laptop" in unknown.output
    done = CliRunner().invoke(app, ["revoke", "laptop", "--home", str(home)], env=env)
    assert done.exit_code == 0 and "next `tessera up`" in done.output, done.output
    kept = AccessControl(["worker-0"], path=home / "access.json")
    assert "laptop" not in kept.passwords and kept.joined == []


def test_a_joined_host_gives_up_once_its_secret_keeps_being_refused() -> None:
    """Three refusals in a row (none accepted between): revoked, or the cluster started over."""
    from libs.cluster.joined import Refusals

    refusals = Refusals()
    refused = {"msg": "nats error", "error": "Error(\"nats: 'Authorization Violation'\")"}
    for _ in range(2):
        refusals.hear(refused)
    refusals.hear({"msg": "nats reconnected"})  # accepted between: a passing refusal
    refusals.hear(refused)
    refusals.hear({"msg": "nats error", "error": "ConnectionRefusedError()"})
    assert not refusals.refused()
    refusals.hear(refused)
    refusals.hear(refused)
    assert refusals.refused()
