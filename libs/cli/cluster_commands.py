"""The commands that start, join and guard a cluster: ``tessera up``, ``join``, ``token
rotate``, ``revoke`` and ``access`` (the users and passwords for ``docker compose``); those of
a home, ``reset`` and ``keys``, are ``home_commands.py``'s.

Each is a plain function; ``libs/cli/main.py`` registers it on the ``tessera`` app (the
``token`` group, ``token_app``, is built here).
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from libs.cluster import runfile
from libs.runtime.procs import free_port
from libs.runtime.settings import LauncherSettings


class CpuEngine(StrEnum):
    torch = "torch"
    llamacpp = "llamacpp"


def up(
    devices: Annotated[
        int | None, typer.Option(min=0, help="Emulated devices to start (default 6).")
    ] = None,
    fleet: Annotated[
        Path | None,
        typer.Option(
            exists=True, dir_okay=False, help="Fleet file (YAML or TOML) for the emulated fleet."
        ),
    ] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Gateway port (TESSERA_GATEWAY_PORT).")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(min=0, max=64, help="CPU shard workers, one device each (default 2)."),
    ] = None,
    vllm_workers: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=16,
            help="vLLM workers (whole models; `make vllm` first). Default: 1 with an NVIDIA GPU "
            "and vLLM's GPU build, else 0 (on CPU the shard workers, which can split a model).",
        ),
    ] = None,
    engine: Annotated[
        CpuEngine | None,
        typer.Option(
            help="The CPU workers' engine. Default: llamacpp where `make llama` built it "
            "(the faster here), else torch.",
        ),
    ] = None,
    scheduler_replicas: Annotated[
        int | None,
        typer.Option(min=1, max=5, help="Scheduler replicas: one leads, the others stand by."),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            help="An address of this host others reach: NATS listens there and other hosts "
            "join with the `tessera join …` command printed at start. Default: loopback only."
        ),
    ] = None,
    nats_servers: Annotated[
        int,
        typer.Option(
            min=1,
            max=9,
            help="nats-servers in one NATS cluster (3 or more: the cluster goes on when one "
            "goes; JetStream keeps three copies). Default 1.",
        ),
    ] = 1,
    deploy: Annotated[
        list[str] | None,
        typer.Option(
            "--deploy",
            help="A model to deploy once the cluster is up (repeat for more; default "
            "smollm2-135m-instruct; `none`: nothing). Each is followed until it serves, or its "
            "refusal is said.",
        ),
    ] = None,
    home: Annotated[
        Path | None,
        typer.Option(
            envvar="TESSERA_HOME",
            help="The cluster's home: its models, deployments, users, token and keys, kept "
            "across restarts. Default: $XDG_DATA_HOME/tessera/default "
            "(~/.local/share/tessera/default).",
        ),
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option("--fresh", help="Start over: delete what the home holds (each item said)."),
    ] = False,
    restart: Annotated[
        str,
        typer.Option(
            help="on-failure: a service that exits is started again, with backoff (`tessera "
            "status` shows restarts); no: one that exits stops the cluster.",
        ),
    ] = "on-failure",
    open_lan: Annotated[
        bool,
        typer.Option(
            "--open",
            help="Serve a gateway bound beyond loopback (TESSERA_GATEWAY_HOST) with no API key "
            "(refused otherwise; `tessera keys create NAME` makes one).",
        ),
    ] = False,
) -> None:
    """Start NATS, Redis and every service on this machine; Ctrl-C stops them all. Started
    again on the same home, it is the same cluster: its models, deployments and token."""
    from libs.cluster import engine_choice as engines
    from libs.cluster.up import run_cluster
    from libs.cluster.up_options import UpOptions, choose_port, choose_run_file
    from libs.runtime.settings import default_home

    if nats_servers == 2:
        raise typer.BadParameter(
            "two servers lose JetStream's quorum when one goes: use 1, or 3 or more",
            param_hint="--nats-servers",
        )
    if restart not in ("on-failure", "no"):
        raise typer.BadParameter(f"{restart!r}: on-failure or no", param_hint="--restart")
    try:
        settings = LauncherSettings()
    except ValidationError as exc:  # say what is wrong in one line per setting
        for error in exc.errors():
            typer.echo(f"tessera up: {error['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from exc
    built = engines.Built.here()
    asked = settings.vllm_workers if vllm_workers is None else vllm_workers
    vllm, why = engines.vllm_workers(asked, built)
    try:
        cpu, cpu_why = engines.cpu_engine(engine.value if engine else settings.cpu_engine, built)
    except engines.EngineMissing as exc:
        raise typer.BadParameter(str(exc), param_hint="--engine") from exc
    if fleet is not None:
        from libs.devices.fleetfile import fleet_from_file

        try:
            fleet_from_file(fleet)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--fleet") from None
    options = UpOptions(
        gateway_host=settings.gateway_host,
        gateway_port=port or settings.gateway_port or choose_port(settings.gateway_host, 8000),
        devices=settings.devices if devices is None else devices,
        workers=settings.workers if workers is None else workers,
        vllm_workers=vllm,
        cpu_engine=cpu,
        engines_note=f"{cpu_why}; {why}",
        scheduler_replicas=scheduler_replicas or settings.scheduler_replicas,
        fleet=fleet,
        run_file=choose_run_file(settings.run_file),
        scheduler_port=settings.scheduler_http_port or free_port(),
        listen=listen,
        nats_servers=nats_servers,
        nats_tls=(settings.nats_tls_cert, settings.nats_tls_key)
        if settings.nats_tls_cert and settings.nats_tls_key
        else None,
        nats_ca=settings.nats_ca,
        home=home or default_home(),
        fresh=fresh,
        open_lan=open_lan,
        restart=restart == "on-failure",
    )
    if deploy:
        options = dataclasses.replace(options, deploy=tuple(d for d in deploy if d != "none"))
    raise typer.Exit(run_cluster(options))


def join(
    url: Annotated[
        str | None,
        typer.Argument(help="The cluster's NATS URL, as `tessera up` printed (default: mDNS)."),
    ] = None,
    token: Annotated[
        str, typer.Option(envvar="TESSERA_JOIN_TOKEN", help="The cluster's join token.")
    ] = "",
    device_id: Annotated[
        str | None, typer.Option(help="This host's device id (default host-<hostname>).")
    ] = None,
    memory_gb: Annotated[
        float | None,
        typer.Option(min=0.1, help="Memory the scheduler may use here (default: all of it)."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="llamacpp (its RPC between hosts over mutual TLS, the cluster's CA), torch or "
            "vllm. Default: llamacpp where `make llama` built it, else vllm with an NVIDIA GPU "
            "and vLLM's GPU build, else torch."
        ),
    ] = None,
    ca: Annotated[
        Path | None,
        typer.Option(
            envvar="TESSERA_NATS_CA",
            exists=True,
            dir_okay=False,
            help="The cluster's CA (PEM), when its NATS requires TLS: the join command names it.",
        ),
    ] = None,
) -> None:
    """Join the cluster at URL: this host becomes one of its devices until Ctrl-C."""
    from libs.cluster.joined import JoinOptions, run_joined

    if not token:
        raise typer.BadParameter("the cluster's token is needed", param_hint="--token")
    if engine not in (None, "torch", "llamacpp", "vllm"):
        raise typer.BadParameter(f"{engine!r}: torch, llamacpp or vllm", param_hint="--engine")
    options = JoinOptions(url, token, device_id, memory_gb, engine, ca)
    raise typer.Exit(run_joined(options))


token_app = typer.Typer(help="The cluster's join token.", no_args_is_help=True)


@token_app.command("rotate")
def token_rotate() -> None:
    """Draw a new join token: the old one is refused from now on (joined hosts stay)."""
    import asyncio

    from libs.cluster.joining import rotate_token

    admin, ca = running_admin()
    try:
        token = asyncio.run(rotate_token(admin, ca))
    except TimeoutError as exc:
        typer.echo("nobody answered: was the cluster started with --listen?", err=True)
        raise typer.Exit(1) from exc
    except Exception as exc:
        typer.echo(f"the cluster did not rotate its token: {exc!r}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"new join token: {token}")


def running_admin() -> tuple[str, Path | None]:
    """The running cluster's admin NATS URL and its CA (from its run file), or exit 1."""
    settings = LauncherSettings()
    try:
        running = runfile.read(settings.run_file)
        admin, ca = running["nats_url"], running.get("nats_ca")
    except (SystemExit, OSError, ValueError, KeyError) as exc:
        typer.echo(f"no running cluster found ({settings.run_file}): {exc}", err=True)
        raise typer.Exit(1) from exc
    return admin, Path(ca) if ca else None


def revoke(
    device_id: Annotated[str, typer.Argument(help="The joined device to remove.")],
    home: Annotated[
        Path | None, typer.Option(envvar="TESSERA_HOME", help="The home (default: as `up`).")
    ] = None,
) -> None:
    """Remove one joined device's NATS user at once: its connection is closed, its shards
    move, it cannot come back without the join token (rotate it too if that leaked). With no
    cluster running, it is removed from the home: refused from the next `tessera up` on."""
    import asyncio

    from libs.cluster.joining import revoke_device

    if not runfile.held(LauncherSettings().run_file):
        from libs.cli.home_commands import revoke_offline

        revoke_offline(device_id, home)
        return
    admin, ca = running_admin()
    try:
        refused = asyncio.run(revoke_device(admin, device_id, ca))
    except TimeoutError as exc:
        typer.echo("nobody answered: was the cluster started with --listen?", err=True)
        raise typer.Exit(1) from exc
    if refused:
        typer.echo(f"not revoked: {refused}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {device_id}: its user is gone and its shards move")


def access(
    out: Annotated[Path, typer.Option(help="Folder for the files.")] = Path("deploy/access"),
    device: Annotated[
        list[str] | None, typer.Option(help="A worker device (repeat); default: compose's.")
    ] = None,
    nats_servers: Annotated[
        int,
        typer.Option(
            min=1, max=3, help="3: NATS as a cluster of three (compose profile nats-cluster)."
        ),
    ] = 1,
) -> None:
    """Write NATS users, Redis ACL users and their URLs for `docker compose` (new passwords)."""
    from libs.cluster.access import AccessControl, service_grants
    from libs.cluster.compose_access import COMPOSE_DEVICES, write_compose, write_rpc_certificates

    if nats_servers == 2:
        raise typer.BadParameter("use 1 or 3 (quorum)", param_hint="--nats-servers")
    locks = AccessControl(device or list(COMPOSE_DEVICES))
    env = write_compose(locks, out, [*service_grants(), "admin"], nats_servers)
    typer.echo(f"wrote {out}/nats.conf, {out}/users.acl and {env} (mode 0600)")
    for line in write_rpc_certificates(out, list(locks.devices)):
        typer.echo(f"note: {line}")
    typer.echo(f"wrote {out}/rpc/DEVICE: each worker's certificate for llama.cpp's RPC")
    profile = " --profile nats-cluster" if nats_servers > 1 else ""
    typer.echo(f"start with: docker compose{profile} --env-file {env} up")
