"""``tessera jobs submit|list|show|cancel|results``: batches of requests with a deadline, through
the gateway's Batch API (OpenAI's Files and Batches, ``docs/batch.md``).

``submit`` uploads a JSONL file of requests and creates a batch of it that must end within
``--within`` (the deadline): the cluster admits it with a planned finish, or declines it at
once with the reason. With ``--wait`` it then shows a progress bar until the batch ends.
``submit --train`` makes a training job instead: ``--runs`` training runs of ``--steps`` steps
each (or a JSONL file of them), admitted and run by the same policy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from libs.cli.tables import Column, fitted
from libs.contracts.batch_requests import TRAIN_ENDPOINT, TRAIN_MODEL

jobs_app = typer.Typer(help="Batches of requests with a deadline.", no_args_is_help=True)
Url = Annotated[str | None, typer.Option(help="Gateway URL (default: the running cluster).")]
Key = Annotated[str | None, typer.Option(envvar="TESSERA_API_KEY", help="API key.")]
FINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = {"chat": "/v1/chat/completions", "text": "/v1/completions", "embed": "/v1/embeddings"}


def _client(url: str | None, key: str | None) -> httpx.Client:
    from libs.cli.chat import gateway_url
    from libs.runtime.settings import LauncherSettings

    base = gateway_url(url, LauncherSettings().run_file)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(10.0, read=300.0))


def _ask(http: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise SystemExit(f"gateway not reachable at {http.base_url}: {exc}") from None
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise SystemExit(f"error {response.status_code}: {message}")
    return response.json() if "json" in response.headers.get("content-type", "") else response


def with_model(path: Path, model: str | None, endpoint: str) -> bytes:
    """The file's lines; with ``model``, each request's body names it (and the line's url is
    the endpoint) where the line leaves them out."""
    content = path.read_bytes()
    if model is None:
        return content
    out = []
    for raw in content.decode("utf-8", errors="strict").splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            out.append(raw)  # the gateway names the line and its fault
            continue
        if isinstance(line, dict) and isinstance(line.get("body"), dict):
            line["body"].setdefault("model", model)
            line.setdefault("url", endpoint)
            line.setdefault("method", "POST")
        out.append(json.dumps(line))
    return "".join(f"{line}\n" for line in out).encode()


def training_runs(runs: int, steps: int, every: int) -> bytes:
    """A training job's file: ``runs`` runs of ``steps`` steps, seeds 0, 1, …"""
    lines = [
        {
            "custom_id": f"run-{seed}",
            "method": "POST",
            "url": TRAIN_ENDPOINT,
            "body": {"model": TRAIN_MODEL, "steps": steps, "every": every, "seed": seed},
        }
        for seed in range(runs)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@jobs_app.command()
def submit(
    file: Annotated[
        Path | None,
        typer.Argument(exists=True, dir_okay=False, help="A JSONL file (none with --train)."),
    ] = None,
    within: Annotated[str, typer.Option(help="The deadline: 24h, 2h, 30m, 90s.")] = "24h",
    model: Annotated[str | None, typer.Option(help="The model of lines that name none.")] = None,
    endpoint: Annotated[str, typer.Option(help="chat, text or embed.")] = "chat",
    train: Annotated[bool, typer.Option(help="A training job instead.")] = False,
    steps: Annotated[int, typer.Option(min=1, help="--train: steps of each run.")] = 1000,
    runs: Annotated[int, typer.Option(min=1, max=1000, help="--train: how many runs.")] = 1,
    every: Annotated[int, typer.Option(min=1, help="--train: checkpoint each N steps.")] = 50,
    wait: Annotated[bool, typer.Option(help="Show progress until the batch ends.")] = False,
    url: Url = None,
    api_key: Key = None,
) -> None:
    """Submit a file of requests (or, --train, a training job) to end within a deadline."""
    if endpoint not in ENDPOINTS:
        raise typer.BadParameter(f"{endpoint!r}: one of {', '.join(ENDPOINTS)}")
    target = TRAIN_ENDPOINT if train else ENDPOINTS[endpoint]
    if file is None and not train:
        raise typer.BadParameter("a JSONL file of requests (or --train for a training job)")
    try:
        if file is None:
            name, content = "training.jsonl", training_runs(runs, steps, every)
        else:
            name, content = file.name, with_model(file, TRAIN_MODEL if train else model, target)
    except UnicodeDecodeError as exc:
        message = f"{file} is not UTF-8 text (byte {exc.start}): a batch file is JSONL"
        raise SystemExit(message) from None
    with _client(url, api_key) as http:
        uploaded = _ask(
            http, "POST", "/v1/files", data={"purpose": "batch"},
            files={"file": (name, content, "application/jsonl")},
        )  # fmt: skip
        body = {"input_file_id": uploaded["id"], "endpoint": target, "completion_window": within}
        batch = _ask(http, "POST", "/v1/batches", json=body)
        typer.echo(f"{batch['id']}: {batch['decision']}")
        if wait:
            batch = follow(http, batch)
            typer.echo(f"{batch['id']} {batch['status']}: {_counts(batch)}")


def follow(http: httpx.Client, batch: dict[str, Any]) -> dict[str, Any]:
    """A progress bar of the batch's answered requests (a training job's steps) until it
    ends."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(batch["id"], total=_done(batch)[1])
        while batch["status"] not in FINAL:
            time.sleep(1.0)
            batch = _ask(http, "GET", f"/v1/batches/{batch['id']}")
            bar.update(task, completed=_done(batch)[0])
    return batch


def _done(batch: dict[str, Any]) -> tuple[int, int]:
    """(done, total): requests answered, or a training job's steps."""
    training = batch.get("training")
    if training:
        return int(training["steps_done"]), int(training["steps_total"])
    counts = batch["request_counts"]
    return counts["completed"] + counts["failed"], counts["total"]


def _counts(batch: dict[str, Any]) -> str:
    c = batch["request_counts"]
    return f"{c['completed']} answered, {c['failed']} failed of {c['total']}"


def _when(ts: int | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


@jobs_app.command("list")
def list_jobs(url: Url = None, api_key: Key = None) -> None:
    """The batches, newest first."""
    with _client(url, api_key) as http:
        batches = _ask(http, "GET", "/v1/batches", params={"limit": 100})["data"]
    if not batches:
        typer.echo("no batches")
        return
    columns = [
        Column("batch", "left"), Column("model", "left"), Column("status", "left"),
        Column("done"), Column("deadline"), Column("planned end"), Column("ended"),
    ]  # fmt: skip
    rows = [
        [
            b["id"],
            b["model"],
            b["status"],
            f"{b['request_counts']['completed'] + b['request_counts']['failed']}"
            f"/{b['request_counts']['total']}",
            _when(b["expires_at"]),
            _when(b.get("planned_finish_at")),
            _when(b.get(f"{b['status']}_at") if b["status"] in FINAL else None),
        ]
        for b in batches
    ]
    console = Console()
    console.print(fitted(console, "batches", columns, rows))


@jobs_app.command()
def show(batch_id: str, url: Url = None, api_key: Key = None) -> None:
    """One batch, as the API has it (JSON)."""
    with _client(url, api_key) as http:
        typer.echo(json.dumps(_ask(http, "GET", f"/v1/batches/{batch_id}"), indent=2))


@jobs_app.command()
def cancel(batch_id: str, url: Url = None, api_key: Key = None) -> None:
    """Cancel a batch: what was answered is kept."""
    with _client(url, api_key) as http:
        batch = _ask(http, "POST", f"/v1/batches/{batch_id}/cancel")
    typer.echo(f"{batch['id']} {batch['status']}: {_counts(batch)}")


@jobs_app.command()
def results(
    batch_id: str,
    errors: Annotated[bool, typer.Option(help="The error file instead.")] = False,
    url: Url = None,
    api_key: Key = None,
) -> None:
    """A finished batch's output (or error) file, JSONL, to standard output."""
    with _client(url, api_key) as http:
        batch = _ask(http, "GET", f"/v1/batches/{batch_id}")
        file_id = batch["error_file_id" if errors else "output_file_id"]
        if batch["status"] not in FINAL:
            raise SystemExit(f"{batch_id} is {batch['status']}: {_counts(batch)}; no file yet")
        if file_id is None:
            raise SystemExit(
                f"{batch_id} {batch['status']} with no {'error' if errors else 'output'} file"
            )
        sys.stdout.write(_ask(http, "GET", f"/v1/files/{file_id}/content").text)
