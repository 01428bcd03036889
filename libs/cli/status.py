"""``tessera status``: each service of the running ``tessera up`` (from its run file): running,
restarting or failed, how often it was started again and how it last ended."""

from __future__ import annotations

import typer

from libs.cluster import runfile
from libs.runtime.settings import LauncherSettings


def status() -> None:
    """Each service of the running cluster: running, restarting or failed (exit 1 when one
    has failed), its restarts and how it last ended."""
    recorded = runfile.read(LauncherSettings().run_file)
    services: dict[str, dict[str, object]] = recorded.get("services") or {}
    if not services:
        typer.echo("the cluster is still starting: no service is watched yet")
        return
    width = max(len(name) for name in services)
    for name, service in services.items():
        line = f"{name:<{width}}  {service['state']:<10}  restarts {service['restarts']}"
        if service.get("last_exit"):
            line += f"  last: {service['last_exit']}"
        typer.echo(line)
    failed = [name for name, s in services.items() if s["state"] == "failed"]
    if failed:
        typer.echo(f"failed (kept crashing; the rest serves on): {', '.join(failed)}", err=True)
        raise typer.Exit(1)
