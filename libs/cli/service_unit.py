"""``tessera service install``: a systemd unit that starts ``tessera up`` (or, on a joined host,
``tessera join``) at boot and again if it stops, so a cluster survives a reboot with nobody at
the keyboard. It writes the unit and says the two ``systemctl`` commands that enable it; it runs
neither (the user decides what starts at boot).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from libs.runtime.settings import default_home

service_app = typer.Typer(help="Start the cluster at boot (a systemd unit).", no_args_is_help=True)
ROOT = Path(__file__).resolve().parents[2]


def unit_text(command: list[str], description: str, env: dict[str, str], user: bool) -> str:
    """A systemd service unit running ``command`` from the checkout, restarted on failure."""
    lines = [
        "[Unit]",
        f"Description={description}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"WorkingDirectory={ROOT}",
        *(f'Environment="{key}={value}"' for key, value in env.items()),
        f"ExecStart={shlex.join(command)}",
        "Restart=on-failure",
        "RestartSec=5",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=90",
        "",
        "[Install]",
        f"WantedBy={'default.target' if user else 'multi-user.target'}",
        "",
    ]
    return "\n".join(lines)


def unit_path(name: str, user: bool) -> Path:
    if user:
        return Path.home() / ".config" / "systemd" / "user" / f"{name}.service"
    return Path("/etc/systemd/system") / f"{name}.service"


@service_app.command("install")
def install(
    join: Annotated[
        str | None,
        typer.Option(help="On a joined host: the cluster's NATS URL (a unit for `tessera join`)."),
    ] = None,
    token: Annotated[
        str, typer.Option(envvar="TESSERA_JOIN_TOKEN", help="With --join: the join token.")
    ] = "",
    home: Annotated[
        Path | None, typer.Option(envvar="TESSERA_HOME", help="The cluster's home (as `up`).")
    ] = None,
    args: Annotated[str, typer.Option(help="More options for `tessera up` or `join`.")] = "",
    path: Annotated[Path | None, typer.Option(help="Where to write the unit.")] = None,
) -> None:
    """Write a systemd unit for `tessera up` (or `tessera join` with --join); root gets a
    system unit, anyone else a user unit. Says how to enable it."""
    user = os.getuid() != 0
    tessera = str(Path(sys.executable).parent / "tessera")
    env: dict[str, str] = {"COLUMNS": "160"}
    if join is None:
        place = (home or default_home()).resolve()
        command = [tessera, "up", "--home", str(place), *shlex.split(args)]
        name, description = "tessera", f"Tessera cluster (home {place})"
    else:
        if not token:
            raise typer.BadParameter(
                "a joined host's unit needs the join token", param_hint="--token"
            )
        command = [tessera, "join", join, *shlex.split(args)]
        env["TESSERA_JOIN_TOKEN"] = token  # read by `tessera join`; the unit is kept private
        name, description = "tessera-join", f"Tessera: this host as a device of {join}"
    target = path or unit_path(name, user)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch(mode=0o600)
    target.chmod(0o600)  # a joined host's unit holds its token
    target.write_text(unit_text(command, description, env, user))
    scope = " --user" if user else ""
    typer.echo(f"wrote {target}")
    typer.echo(
        f"enable it with: systemctl{scope} daemon-reload && "
        f"systemctl{scope} enable --now {target.stem}"
    )
    if user:
        typer.echo("(a user unit starts at boot once `loginctl enable-linger` is set for you)")
