"""The commands that ask the scheduler: ``tessera preview``, ``deploy``, ``placements`` and
``mode``. Each is a plain function that ``libs/cli/main.py`` registers on the ``tessera`` app;
the work and the tables are ``libs/cli/scheduling.py``'s.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from libs.contracts import DEFAULT_CONTEXT_TOKENS
from libs.runtime.settings import LauncherSettings

SchedulerUrl = Annotated[
    str | None, typer.Option(help="Scheduler API (default: the running `tessera up`).")
]


class PrecisionChoice(StrEnum):
    int8 = "int8"
    bfloat16 = "bfloat16"
    float32 = "float32"


PrecisionOption = Annotated[
    PrecisionChoice | None,
    typer.Option(help="Weights' precision on the CPU shard engine (default: the model's, int8)."),
]


def _scheduler(explicit: str | None) -> str:
    from libs.cli.scheduling import scheduler_url

    return scheduler_url(explicit, LauncherSettings().run_file)


def preview(
    model: str,
    max_shards: Annotated[int, typer.Option(min=1, max=256)] = 8,
    precision: PrecisionOption = None,
    scheduler_url: SchedulerUrl = None,
) -> None:
    """Every candidate placement of MODEL (a registered name; or a FILE.gguf, a model's
    FOLDER, a URL or hf:ORG/REPO: read here, downloaded first where it is remote, not added):
    layers and memory per device, or why not."""
    from libs.cli.model_commands import file_card
    from libs.cli.scheduling import show_previews

    base, chosen = _scheduler(scheduler_url), precision and precision.value
    found = file_card(base, model)
    if found is None:
        show_previews(base, model, max_shards, chosen)
    elif isinstance(found, str):  # the cluster has this file: its registered name
        typer.echo(f"{model} is registered as {found}")
        show_previews(base, found, max_shards, chosen)
    else:
        show_previews(base, found.name, max_shards, chosen, card=found)


def deploy(
    model: str,
    deployment_id: Annotated[str | None, typer.Option("--id", help="Deployment id.")] = None,
    max_shards: Annotated[int, typer.Option(min=1, max=256)] = 8,
    replicas: Annotated[
        int, typer.Option(min=1, max=16, help="Copies; each request goes to one of them.")
    ] = 1,
    precision: PrecisionOption = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0, help="Seconds to wait until it serves (0: do not wait); exit 2 past them."
        ),
    ] = 600.0,
    context: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=1_048_576,
            help=f"Context length per request, tokens (default: {DEFAULT_CONTEXT_TOKENS}, or "
            "less where the model or its workers allow less).",
        ),
    ] = None,
    shards: Annotated[
        int | None, typer.Option(min=1, max=256, help="Exactly this many shards per copy.")
    ] = None,
    devices: Annotated[
        str | None, typer.Option(help="Exactly these devices, in pipeline order: A,B,…")
    ] = None,
    scheduler_url: SchedulerUrl = None,
) -> None:
    """Deploy MODEL (a registered name; or a FILE.gguf, a model's FOLDER, a URL or
    hf:ORG/REPO, added first as `tessera models add` adds it) across the fleet (split
    into shards where needed) and wait until it serves, showing its progress; exit 1 with the
    reason when it is refused or fails. Told --shards or --devices, the scheduler does exactly
    that or refuses saying why."""
    from rich.console import Console

    from libs.cli.model_commands import model_name
    from libs.cli.scheduling import deploy as run

    base, console = _scheduler(scheduler_url), Console()
    name = model_name(base, model, console)
    told = {
        "context_length": context,
        "shards": shards,
        "devices": [d for d in (devices or "").split(",") if d],
    }
    chosen = precision and precision.value
    code = run(base, name, deployment_id, max_shards, replicas, chosen, timeout, console, told=told)
    raise typer.Exit(code)


def placements(scheduler_url: SchedulerUrl = None) -> None:
    """The live deployments and their shards."""
    from libs.cli.scheduling import show_placements

    show_placements(_scheduler(scheduler_url))


def mode(
    name: Annotated[
        str | None, typer.Argument(help="performance, energy, balanced or auto")
    ] = None,
    scheduler_url: SchedulerUrl = None,
) -> None:
    """Show the scheduling mode, or set it (auto: back to automatic switching)."""
    from libs.cli.scheduling import mode as run

    run(_scheduler(scheduler_url), name)
