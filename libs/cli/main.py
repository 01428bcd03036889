"""``tessera``: start the local cluster and operate it.

The app and its whole command tree, in the order ``tessera --help`` lists it. The commands live
by what they do: ``cluster_commands.py`` (up, join, token, revoke, access), ``home_commands.py``
(reset, keys), ``scheduling_commands.py`` (preview, deploy, placements, mode),
``model_commands.py`` (``models …``), ``job_commands.py`` (``jobs …``),
``simulate_commands.py`` (``simulate``); the few that stand alone (devices, calibrate, chat,
version) are here. ``main`` is the ``tessera`` entry point.
"""

from __future__ import annotations

from typing import Annotated

import typer

from libs.cli.cluster_commands import access, join, revoke, token_app, up
from libs.cli.home_commands import keys_app, reset
from libs.cli.job_commands import jobs_app
from libs.cli.model_commands import models_app
from libs.cli.scheduling_commands import deploy, mode, placements, preview
from libs.cli.service_unit import service_app
from libs.cli.simulate_commands import simulate_app
from libs.cli.status import status
from libs.runtime.settings import LauncherSettings

app = typer.Typer(
    name="tessera",
    help="Tessera: run AI work across a fleet of unlike devices.",
    no_args_is_help=True,
    add_completion=False,
)


def devices(
    redis_url: Annotated[str | None, typer.Option(help="Redis of the cluster.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Rows to show.")] = 50,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however narrow.")] = False,
) -> None:
    """List devices with class, state, the five scores and the total (best first)."""
    from libs.cli.devices import redis_url as resolve
    from libs.cli.devices import show_devices

    settings = LauncherSettings()
    url = resolve(redis_url or settings.redis_url, settings.run_file)
    show_devices(url, settings.key_prefix, limit, json_output, wide)


def calibrate() -> None:
    """Measure this host's FP32, INT8 and memory bandwidth (and cache the result)."""
    from rich.progress import Progress

    from libs.devices.calibration import measure

    with Progress() as bar:
        task = bar.add_task("calibrating", total=3)

        def progress(step: str, done: int, total: int) -> None:
            bar.update(task, completed=done, description=step)

        result = measure(progress)
    typer.echo(
        f"fp32 {result.fp32_gflops:.1f} GFLOP/s, int8 {result.int8_gops:.1f} Gop/s, "
        f"memory {result.memory_bandwidth_gbps:.1f} GB/s ({result.seconds:.1f} s)"
    )


def chat(
    model: Annotated[str, typer.Option(help="Model id from /v1/models.")] = "smollm2-135m-instruct",
    url: Annotated[
        str | None, typer.Option(help="Gateway URL (default: the running cluster).")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TESSERA_API_KEY")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=4096)] = 256,
    message: Annotated[
        str | None, typer.Option("--message", "-m", help="Ask once and exit.")
    ] = None,
) -> None:
    """Chat with a deployed model through the gateway (Ctrl-D to leave)."""
    from libs.cli.chat import chat as run_chat
    from libs.cli.chat import gateway_url

    settings = LauncherSettings()
    run_chat(gateway_url(url, settings.run_file), model, api_key, max_tokens, message)


def version() -> None:
    """Print Tessera's version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("tessera"))


# Commands are listed in the order they are added; groups after them, in theirs.
app.command()(up)
app.command()(join)
app.add_typer(token_app, name="token")
app.command()(revoke)
app.command()(devices)
app.command()(preview)
app.command()(deploy)
app.command()(placements)
app.command()(mode)
app.command()(calibrate)
app.add_typer(simulate_app, name="simulate")
app.add_typer(models_app, name="models")
app.add_typer(jobs_app, name="jobs")
app.command()(chat)
app.command()(access)
app.command()(status)
app.command()(reset)
app.add_typer(keys_app, name="keys")
app.add_typer(service_app, name="service")
app.command()(version)


def main() -> None:
    """The ``tessera`` entry point (pyproject's ``[project.scripts]``)."""
    app()


if __name__ == "__main__":
    main()
