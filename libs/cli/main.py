"""``tessera``: start the local cluster and operate it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from libs.runtime.settings import LauncherSettings

app = typer.Typer(
    name="tessera",
    help="Tessera: run AI work across a fleet of unlike devices.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def up(
    devices: Annotated[
        int | None, typer.Option(min=0, help="Emulated devices to start (default 6).")
    ] = None,
    fleet: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="Fleet file (YAML) for the emulated fleet."),
    ] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Gateway port (TESSERA_GATEWAY_PORT).")
    ] = None,
) -> None:
    """Start NATS, Redis and every service on this machine; Ctrl-C stops them all."""
    from libs.runtime.launcher import UpOptions, run_cluster

    settings = LauncherSettings()
    options = UpOptions(
        gateway_host=settings.gateway_host,
        gateway_port=port or settings.gateway_port,
        devices=settings.devices if devices is None else devices,
        fleet=fleet,
    )
    raise typer.Exit(run_cluster(options))


@app.command()
def version() -> None:
    """Print Tessera's version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("tessera"))


def main() -> None:
    app()
