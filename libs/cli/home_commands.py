"""The commands of a cluster's home (``libs/cluster/home.py``), which work with the cluster
stopped: ``tessera reset``, ``keys create|list|revoke``, and ``revoke`` of a joined device
while no cluster runs (``cluster_commands.revoke`` hands it here).

Each is a plain function; ``libs/cli/main.py`` registers it on the ``tessera`` app (the
``keys`` group, ``keys_app``, is built here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

HomeOption = Annotated[
    Path | None, typer.Option(envvar="TESSERA_HOME", help="The home (default: as `up`).")
]


def reset(
    home: HomeOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Delete without asking.")] = False,
) -> None:
    """Start over: delete what a stopped cluster's home holds (its models, deployments,
    users, join token and keys), each item said. Refused while a cluster runs on it."""
    from libs.cluster.home import Home, HomeRefused
    from libs.runtime.settings import default_home

    place = Home(home or default_home())
    try:
        place.check_owner()
        lock = place.lock()
    except HomeRefused as exc:
        typer.echo(f"tessera reset: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        items = place.contents()
        if not items:
            typer.echo(f"{place.path} holds nothing to delete")
            return
        for line in items:
            typer.echo(f"will delete {line}")
        if not yes and not typer.confirm("delete all of it?"):
            raise typer.Exit(1)
        for line in place.wipe():
            typer.echo(f"deleted {line}")
    finally:
        os.close(lock)


keys_app = typer.Typer(
    help="The gateway's API keys, kept hashed in the cluster's home.", no_args_is_help=True
)


def keys_file(home: Path | None) -> Path:
    from libs.cluster.home import Home, HomeRefused
    from libs.runtime.settings import default_home

    place = Home(home or default_home())
    try:
        place.prepare()
    except HomeRefused as exc:
        typer.echo(f"tessera keys: {exc}", err=True)
        raise typer.Exit(2) from exc
    return place.keys_file


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="What the key is for (a person, a program).")],
    home: HomeOption = None,
) -> None:
    """Make a key: printed once here, stored only as its hash. The gateway asks for a key
    from now on (a running cluster that was open: from its next start)."""
    from libs.runtime.api_keys import create_key

    try:
        key = create_key(keys_file(home), name)
    except ValueError as exc:
        typer.echo(f"tessera keys create: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"key {name}: {key}")
    typer.echo("shown only now: keep it (clients send it as `Authorization: Bearer KEY`)")


@keys_app.command("list")
def keys_list(home: HomeOption = None) -> None:
    """The keys by name and date made (never the keys themselves)."""
    import datetime

    from libs.runtime.api_keys import read_keys

    found = read_keys(keys_file(home))
    if not found:
        typer.echo("no keys: the gateway is open on loopback, refused on the LAN without --open")
    for key in found:
        made = datetime.datetime.fromtimestamp(key.created).isoformat(timespec="seconds")
        typer.echo(f"{key.name}  made {made}")


@keys_app.command("revoke")
def keys_revoke(
    name: Annotated[str, typer.Argument(help="The key's name.")], home: HomeOption = None
) -> None:
    """Remove a key: the gateway refuses it within a second, without a restart."""
    from libs.runtime.api_keys import revoke_key

    if not revoke_key(keys_file(home), name):
        typer.echo(f"tessera keys revoke: no key named {name!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {name}")


def revoke_offline(device_id: str, home: Path | None) -> None:
    """``revoke`` while the cluster is stopped: the device's user leaves the home's users."""
    from libs.cluster.access import AccessControl
    from libs.cluster.home import Home, HomeRefused
    from libs.runtime.settings import default_home

    place = Home(home or default_home())
    if not place.access_file.exists():
        typer.echo(f"tessera revoke: no cluster runs, and {place.path} holds no users", err=True)
        raise typer.Exit(1)
    try:
        lock = place.lock()  # no `tessera up` may start on it meanwhile
    except HomeRefused as exc:
        typer.echo(f"tessera revoke: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        access = AccessControl([], path=place.access_file)
        if device_id not in access.joined:
            joined = ", ".join(access.joined) or "none"
            typer.echo(
                f"tessera revoke: no joined device {device_id!r} (joined: {joined})", err=True
            )
            raise typer.Exit(1)
        access.revoke(device_id, offline=True)
    finally:
        os.close(lock)
    typer.echo(
        f"revoked {device_id} in {place.path} (no cluster runs): its secret is refused from the "
        "next `tessera up`, which moves its shards at once"
    )
