"""``tessera preview|deploy|placements|mode``: the scheduler's HTTP API from a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from libs.cli.tables import Column, fitted
from libs.cluster import runfile
from libs.cluster.up import FINAL_PHASES, follow_deployment, phase_text
from libs.contracts import DeploymentsSnapshot
from libs.deployments import DeploymentBook, phases


def scheduler_url(explicit: str | None, run_file: Path) -> str:
    if explicit:
        return explicit.rstrip("/")
    return str(runfile.read(run_file)["scheduler_url"])


def call(method: str, url: str, **kwargs: Any) -> Any:
    try:
        response = httpx.request(method, url, timeout=30, **kwargs)
    except httpx.HTTPError as exc:
        raise SystemExit(f"scheduler not reachable at {url}: {exc}") from None
    if response.status_code >= 400:
        detail = response.json().get("detail", response.text) if response.content else ""
        if isinstance(detail, list):  # FastAPI validation errors: field and message
            detail = "; ".join(f"{e['loc'][-1] if e['loc'] else ''}: {e['msg']}" for e in detail)
        raise SystemExit(f"error {response.status_code}: {detail}")
    return response.json() if response.content else None


SHARD_COLUMNS = [Column("shard"), Column("device", "left"), Column("layers"), Column("GB")]


def shards_table(title: str, shards: list[dict[str, Any]]) -> Table:
    """Each shard's device, layers and host memory; where one holds layers in a GPU's memory
    (counted apart), its VRAM and how many layers sit there."""
    gpu = any(s.get("vram_gb") for s in shards)
    rows = [
        [
            str(s["shard_index"]),
            s["device_id"],
            f"{s['layer_start']}–{s['layer_end'] - 1}",
            f"{s['memory_gb']:.2f}",
            *([f"{s.get('vram_gb', 0.0):.2f} ({s.get('gpu_layers', 0)} layers)"] if gpu else []),
        ]
        for s in shards
    ]
    columns = [*SHARD_COLUMNS, *([Column("VRAM GB")] if gpu else [])]
    return fitted(Console(), title, columns, rows)


def show_previews(
    base: str, model: str, max_shards: int, precision: str | None = None, card: Any = None
) -> None:
    """The candidate placements of registered ``model``, or of ``card`` (a model's file read
    here, not registered: nothing is added)."""
    asked: dict[str, Any] = {
        "max_shards": max_shards,
        **({"precision": precision} if precision else {}),
    }
    url = f"{base}/instance/previews"
    if card is None:
        options = call("GET", url, params={"model": model, **asked})
    else:
        options = call("POST", url, json={"card": card.model_dump(mode="json"), **asked})
    console = Console()
    for option in options:
        n = len(option["devices"])
        if option["feasible"]:
            title = f"{n} device(s): ~{option['step_ms']:.2f} ms/token step"
            if guess := option.get("predicted"):
                title += (
                    f"; predicted {guess['tokens_per_s_1']:.1f} tokens/s at 1 stream, "
                    f"{guess['tokens_per_s_8']:.1f} at 8, first token in {guess['ttft_ms']:.0f} "
                    f"ms, {guess['watts_1']:.0f} W at 1 stream"
                )
            console.print(shards_table(title, option["shards"]))
        else:
            console.print(f"[red]{n} device(s): infeasible[/red] — {option['reason']}")


def deploy(
    base: str,
    model: str,
    deployment_id: str | None,
    max_shards: int,
    replicas: int = 1,
    precision: str | None = None,
    timeout_s: float = 600.0,
    console: Console | None = None,
    told: dict[str, Any] | None = None,
) -> int:
    """Deploy ``model`` and follow it until it serves (exit status 0), is refused or fails
    (1, with the reason) or ``timeout_s`` passes (2); ``timeout_s`` 0: do not wait. ``told``:
    more of the deploy's fields (context_length, shards, devices), where set."""
    console = console or Console()
    body: dict[str, Any] = {"model": model, "max_shards": max_shards, "replicas": replicas}
    body |= {k: v for k, v in (told or {}).items() if v not in (None, [], ())}
    if deployment_id:
        body["deployment_id"] = deployment_id
    if precision:
        body["precision"] = precision
    decision = call("POST", f"{base}/placements", json=body)
    name = decision["task_id"]
    console.print(
        shards_table(f"placed {name} (epoch {decision['epoch']})", decision["assignments"])
    )
    copies = [name]
    if replicas > 1:
        placed = [d for d in call("GET", f"{base}/placements") if d.get("replica_of") == name]
        for d in placed:
            console.print(shards_table(f"replica {d['deployment_id']}", d["assignments"]))
            copies.append(d["deployment_id"])
        if len(placed) < replicas - 1:
            console.print(f"{1 + len(placed)} of {replicas} replicas placed: the fleet is full")
    if timeout_s <= 0:
        return 0
    worst = 0
    for copy in copies:
        status = follow(base, copy, timeout_s, console)
        phase = status["phase"] if status else None
        line = phase_text(copy, status, timeout_s)
        console.print(f"[green]{line}[/green]" if phase == "serving" else f"[red]{line}[/red]")
        code = 0 if phase == "serving" else 1 if phase in FINAL_PHASES else 2
        worst = max(worst, code)
    return worst


def follow(
    base: str, deployment_id: str, timeout_s: float, console: Console
) -> dict[str, Any] | None:
    """Follow a deployment until its phase is final, with a progress bar on a terminal (a
    line per phase, and per tenth loaded, elsewhere)."""
    if not console.is_terminal:
        said: list[tuple[str, int]] = []

        def line(status: dict[str, Any]) -> None:
            key = (status["phase"], int(status.get("progress", 0.0) * 10))
            if status["phase"] not in FINAL_PHASES and key not in said:
                said.append(key)
                console.print(f"{deployment_id} {key[0]}: {key[1] * 10} %")

        return follow_deployment(base, deployment_id, timeout_s, on_change=line)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), console=console
    ) as bar:
        task = bar.add_task(f"{deployment_id} pending", total=1.0)

        def draw(status: dict[str, Any]) -> None:
            description = f"{deployment_id} {status['phase']}"
            bar.update(task, completed=status.get("progress", 0.0), description=description)

        return follow_deployment(base, deployment_id, timeout_s, on_change=draw)


def show_placements(base: str) -> None:
    """Every deployment of the deployment book (``GET /deployments``) with its shards."""
    console = Console()
    book = DeploymentBook.of(DeploymentsSnapshot.model_validate(call("GET", f"{base}/deployments")))
    if not len(book):
        console.print("no deployments")
    for d in book:
        phase: str = d.phase
        if phase == "loading":
            phase = f"loading {phases.progress(d) * 100:.0f} %"
        if d.reason and d.phase in phases.FINAL:
            phase = f"{phase}: {d.reason}"
        assignments = [a.model_dump(mode="json") for a in d.assignments]
        console.print(
            shards_table(f"{d.deployment_id}: {d.model} (epoch {d.epoch}), {phase}", assignments)
        )


def mode(base: str, name: str | None) -> None:
    state = (
        call("PUT", f"{base}/mode", json={"mode": name}) if name else call("GET", f"{base}/mode")
    )
    Console().print(
        f"mode: [bold]{state['mode']}[/bold]" + (" (manual)" if state["manual"] else " (automatic)")
    )
