"""``tessera preview|deploy|placements|mode``: the scheduler's HTTP API from a terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from libs.cli.tables import Column, fitted


def scheduler_url(explicit: str | None, run_file: Path) -> str:
    if explicit:
        return explicit.rstrip("/")
    if run_file.exists():
        return str(json.loads(run_file.read_text())["scheduler_url"])
    raise SystemExit(
        f"no running cluster found ({run_file} is missing): start one with `make up`, "
        "or pass --scheduler-url"
    )


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
    rows = [
        [
            str(s["shard_index"]),
            s["device_id"],
            f"{s['layer_start']}–{s['layer_end'] - 1}",
            f"{s['memory_gb']:.2f}",
        ]
        for s in shards
    ]
    return fitted(Console(), title, SHARD_COLUMNS, rows)


def show_previews(base: str, model: str, max_shards: int, precision: str | None = None) -> None:
    params: dict[str, Any] = {"model": model, "max_shards": max_shards}
    if precision:
        params["precision"] = precision
    options = call("GET", f"{base}/instance/previews", params=params)
    console = Console()
    for option in options:
        n = len(option["devices"])
        if option["feasible"]:
            console.print(
                shards_table(
                    f"{n} device(s): ~{option['step_ms']:.2f} ms/token step", option["shards"]
                )
            )
        else:
            console.print(f"[red]{n} device(s): infeasible[/red] — {option['reason']}")


def deploy(
    base: str,
    model: str,
    deployment_id: str | None,
    max_shards: int,
    replicas: int = 1,
    precision: str | None = None,
) -> None:
    body: dict[str, Any] = {"model": model, "max_shards": max_shards, "replicas": replicas}
    if deployment_id:
        body["deployment_id"] = deployment_id
    if precision:
        body["precision"] = precision
    decision = call("POST", f"{base}/placements", json=body)
    console = Console()
    console.print(
        shards_table(
            f"deployed {decision['task_id']} (epoch {decision['epoch']})", decision["assignments"]
        )
    )
    if replicas > 1:
        placed = [
            d
            for d in call("GET", f"{base}/placements")
            if d.get("replica_of") == decision["task_id"]
        ]
        for d in placed:
            console.print(shards_table(f"replica {d['deployment_id']}", d["assignments"]))
        if len(placed) < replicas - 1:
            console.print(f"{1 + len(placed)} of {replicas} replicas placed: the fleet is full")


def show_placements(base: str) -> None:
    console = Console()
    deployments = call("GET", f"{base}/placements")
    if not deployments:
        console.print("no deployments")
    for d in deployments:
        console.print(
            shards_table(
                f"{d['deployment_id']}: {d['model']} (epoch {d['epoch']})", d["assignments"]
            )
        )


def mode(base: str, name: str | None) -> None:
    state = (
        call("PUT", f"{base}/mode", json={"mode": name}) if name else call("GET", f"{base}/mode")
    )
    Console().print(
        f"mode: [bold]{state['mode']}[/bold]" + (" (manual)" if state["manual"] else " (automatic)")
    )
