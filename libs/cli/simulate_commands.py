"""The ``tessera simulate`` commands: one policy, or several compared on the same workload
(the work itself is in ``libs/cli/simulate.py``, imported when a command runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from libs.contracts import Mode
from libs.sim.data import A100_PROFILES, AZURE_CODE

simulate_app = typer.Typer(
    help="Simulate policies on a workload and a fleet.",
    invoke_without_command=True,
    no_args_is_help=False,
)

Workload = Annotated[Path, typer.Option(help="Trace CSV (Azure LLM columns).")]
Kind = Annotated[str, typer.Option(help="requests (LLM inference) or jobs (deep learning).")]
Fleet = Annotated[str, typer.Option(help="Built-in fleet (seed, cloud-edge, gpu-cluster) or YAML.")]
ModeOption = Annotated[Mode, typer.Option(help="Scheduling mode for DWPS.")]
Load = Annotated[float, typer.Option(min=0.01, help="Request-rate multiplier.")]
Seed = Annotated[int, typer.Option(help="Random seed.")]
Limit = Annotated[int | None, typer.Option(min=1, help="Use the first N requests.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Model = Annotated[
    str,
    typer.Option(
        help="Model served (a hypothetical one: libs/core/catalogue.py HYPOTHETICAL_MODELS)."
    ),
]
Profiles = Annotated[
    Path, typer.Option(help="Throughput profiles for --kind jobs: one <model>.csv per model.")
]
Gpus = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Cloud GPUs for --kind jobs (default: the ElasticFlow paper's cluster for a "
        "shipped trace — 128 for 195job, 512 for cluster01/03/05 — else the fleet's).",
    ),
]
EdgeServers = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Edge servers for --kind jobs, drawn as the bench draws them (16/32 GB, "
        "0.2–0.4 × an A100, from --seed; default: 16 for a shipped trace, else the fleet's).",
    ),
]
DEFAULT_TRACE = AZURE_CODE
REQUEST_DEFAULTS = "dwps,random,round_robin,least_connections"
JOB_DEFAULTS = "edgeflow,elasticflow,edf,tiresias,gandiva,elasticflow-each,elasticflow-noadmit"


@simulate_app.callback()
def simulate(
    ctx: typer.Context,
    workload: Workload = DEFAULT_TRACE,
    kind: Kind = "requests",
    fleet: Fleet = "seed",
    policy: Annotated[
        str | None, typer.Option(help="Policy name (default: dwps; edgeflow for jobs).")
    ] = None,
    mode: ModeOption = Mode.BALANCED,
    load: Load = 1.0,
    seed: Seed = 0,
    limit: Limit = None,
    json_output: Json = False,
    model: Model = "llama-3.2-1b-instruct",
    profiles: Profiles = A100_PROFILES,
    gpus: Gpus = None,
    edge_servers: EdgeServers = None,
) -> None:
    """Simulate one policy and print its metrics (or use `compare`)."""
    if ctx.invoked_subcommand is not None:
        return
    from libs.cli.simulate import run_one

    run_one(
        workload,
        kind,
        fleet,
        policy or ("edgeflow" if kind == "jobs" else "dwps"),
        mode,
        load,
        seed,
        limit,
        json_output,
        model,
        profiles,
        gpus,
        edge_servers,
    )


@simulate_app.command("compare")
def simulate_compare(
    policies: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated policy names (default: dwps,random,round_robin,"
            "least_connections; for jobs edgeflow,elasticflow,edf,tiresias,gandiva,"
            "elasticflow-each,elasticflow-noadmit; edgeflow-each too)."
        ),
    ] = None,
    workload: Workload = DEFAULT_TRACE,
    kind: Kind = "requests",
    fleet: Fleet = "seed",
    mode: ModeOption = Mode.BALANCED,
    load: Load = 1.0,
    seed: Seed = 0,
    limit: Limit = None,
    json_output: Json = False,
    plot: Annotated[Path | None, typer.Option(help="Write PNG charts here.")] = None,
    model: Model = "llama-3.2-1b-instruct",
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however narrow.")] = False,
    profiles: Profiles = A100_PROFILES,
    gpus: Gpus = None,
    edge_servers: EdgeServers = None,
) -> None:
    """Run several policies on the same workload and seed; a table, JSON or charts."""
    from libs.cli.simulate import compare

    if policies is None:
        policies = JOB_DEFAULTS if kind == "jobs" else REQUEST_DEFAULTS
    names = [p.strip() for p in policies.split(",") if p.strip()]
    compare(
        workload,
        kind,
        fleet,
        names,
        mode,
        load,
        seed,
        limit,
        json_output,
        plot,
        model,
        wide,
        profiles,
        gpus,
        edge_servers,
    )
