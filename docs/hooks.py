"""MkDocs hooks: the configuration page is rendered from the settings classes themselves, and
the benchmark reports in ``bench/results/`` join the site where they are written.

Why a hook and not a page: a table of settings written by hand drifts the day a field is added;
this one is read from the classes (names, types, defaults, bounds, and the ``#:`` comment above
each field) every time the site is built, so it cannot. The reports stay beside the benchmarks
that write them; the site only shows them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Every module whose settings classes the configuration page shows, in the page's order.
SETTINGS_MODULES = (
    "libs.runtime.settings",
    "services.gateway.settings",
    "services.scheduler.settings",
    "services.worker.settings",
    "services.scorer.settings",
    "services.telemetry.settings",
    "services.batch.settings",
)
#: Where the rendered tables go in ``docs/configuration.md``.
MARKER = "<!-- settings tables -->"
#: The benchmark reports shown on the site, at the same path as in the repository.
RESULTS = Path("bench") / "results"
#: Where ``docs/benchmarks.md`` lists every report, whatever reports there are.
REPORTS_MARKER = "<!-- reports -->"
#: What a field means where its class has no ``#:`` comment for it (the shared settings, whose
#: names say most). ``tests/unit/test_docs.py`` fails on a name here that is no field.
MEANINGS = {
    "nats_url": "NATS server; several of a NATS cluster, comma-separated (a client moves to "
    "another when its own goes)",
    "redis_url": "Redis server",
    "log_level": "how much each service logs",
    "log_format": "`json` (one object a line) or `text`",
    "otlp_endpoint": "OpenTelemetry collector (`http://…:4318`), `console`, or "
    "`file:///folder` (spans as JSON lines, one file per process); tracing is off when unset",
    "gateway_host": "where the gateway listens",
    "devices": "emulated devices in the telemetry fleet",
    "workers": "CPU shard workers, one device each",
    "scheduler_replicas": "scheduler replicas: one leads, the others stand by",
}


def settings_classes(module_name: str) -> Iterator[type]:
    """The pydantic-settings classes a module defines (not those it imports)."""
    from pydantic_settings import BaseSettings

    module = importlib.import_module(module_name)
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, BaseSettings)
            and value.__module__ == module_name
        ):
            yield value


def field_comments(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment lines (the ones just above it in the class body), joined."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(inspect.cleandoc("".join(lines)) if lines[0][0] == " " else "".join(lines))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    comments: dict[str, str] = {}
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            row = node.lineno - 2  # the line above, 0-based
            while row >= 0 and lines[row].strip().startswith("#:"):
                above.insert(0, lines[row].strip().removeprefix("#:").strip())
                row -= 1
            comments[node.target.id] = " ".join(above)
    return comments


def type_name(annotation: Any) -> str:
    """A short, readable name of a field's type: ``int``, ``float | None``, ``a | b``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type) and hasattr(annotation, "__members__"):  # an enum
        return " \\| ".join(f"`{member.value}`" for member in annotation)  # type: ignore[attr-defined]
    name = getattr(annotation, "__name__", None) or str(annotation)
    return name.replace("typing.", "")


def shown_default(value: Any) -> str:
    """A default as a reader would type it: paths under the home or the repository shortened,
    so nothing of the machine that built the site shows."""
    from pydantic_core import PydanticUndefined

    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    text = str(getattr(value, "value", value))
    text = text.replace(str(REPO), ".").replace(str(Path.home()), "~")
    return f"`{text}`" if text else '`""`'


def default_of(field: Any) -> Any:
    """A field's default, made by its factory where it has one (``list`` gives ``[]``)."""
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def env_name(cls: type, name: str, field: Any) -> str:
    """The environment variable that sets a field: its shared alias, else prefix + name."""
    alias = field.validation_alias
    choices = getattr(alias, "choices", None)
    if choices:
        upper = [c for c in choices if isinstance(c, str) and c.startswith("TESSERA_")]
        if upper:
            return str(upper[0])
    prefix = str(cls.model_config.get("env_prefix", ""))  # type: ignore[attr-defined]
    if cls.__name__ == "ServiceSettings":  # the base: each service reads it with its prefix
        prefix = "TESSERA_<SERVICE>_"
    return prefix + name.upper()


def bounds(field: Any) -> str:
    """The limits pydantic enforces on a field (``≥ 1``, ``≤ 64``, a pattern), if any."""
    said = []
    for rule in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(rule, attr, None) is not None:
                said.append(f"{sign} {getattr(rule, attr)}")
        if getattr(rule, "pattern", None):
            said.append(f"matches `{rule.pattern}`")
    return ", ".join(said)


def settings_table(cls: type, skip: set[str]) -> str:
    """One markdown table: variable, type, default, meaning; fields in ``skip`` left out."""
    comments = {}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        if klass.__module__.startswith(("libs.", "services.")) and klass is not object:
            comments.update(field_comments(klass))
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in cls.model_fields.items():  # type: ignore[attr-defined]
        if name in skip:
            continue
        meaning = comments.get(name) or field.description or MEANINGS.get(name, "")
        limits = bounds(field)
        if limits:
            meaning = f"{meaning} ({limits})" if meaning else limits
        meaning = meaning.replace("|", "\\|")
        row = (
            f"| `{env_name(cls, name, field)}` | {type_name(field.annotation)} "
            f"| {shown_default(default_of(field))} | {meaning} |"
        )
        rows.append(row)
    return "\n".join(rows)


def environment_reads(module_name: str) -> list[tuple[str, str]]:
    """Variables a settings module reads directly (``os.environ.get("TESSERA_…")``), each
    with the first line of the docstring of the function that reads it."""
    module = importlib.import_module(module_name)
    found = []
    for name, function in vars(module).items():
        if inspect.isfunction(function) and function.__module__ == module_name:
            source = inspect.getsource(function)
            for variable in re.findall(r"environ\.get\(\"(TESSERA_\w+)\"", source):
                doc = inspect.cleandoc(function.__doc__ or name).split("\n\n")[0]
                doc = doc.replace("\n", " ")
                found.append((variable, doc))
    return found


def render_settings() -> str:
    """Every settings class's table, shared settings first, then one section per service."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from libs.runtime.settings import ServiceSettings

    shared = set(ServiceSettings.model_fields)
    parts = []
    for module_name in SETTINGS_MODULES:
        for cls in settings_classes(module_name):
            own = (
                shared if cls is not ServiceSettings and issubclass(cls, ServiceSettings) else set()
            )
            doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            if not doc or doc.startswith(("Usage docs", "Base class")):
                doc = inspect.cleandoc(sys.modules[module_name].__doc__ or "").split("\n")[0]
            source = module_name.replace(".", "/") + ".py"
            prefix = cls.model_config.get("env_prefix", "")  # type: ignore[attr-defined]
            where = f"`{source}`." if prefix in doc else f"Prefix `{prefix}`; `{source}`."
            parts.append(f"### {cls.__name__}\n\n{doc} {where}\n\n{settings_table(cls, own)}")
        reads = environment_reads(module_name)
        if reads:
            rows = ["| variable | meaning |", "| --- | --- |"]
            rows += [f"| `{variable}` | {doc} |" for variable, doc in reads]
            parts.append("### Read directly\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def render_reports() -> str:
    """A list of every report in ``bench/results/``, each linked with its title: a report a
    benchmark adds appears on the site without anyone editing a page."""
    rows = []
    for path in sorted((REPO / RESULTS).glob("*.md")):
        lines = path.read_text().splitlines()
        title = next((line[2:] for line in lines if line.startswith("# ")), path.stem)
        rows.append(f"- [{title}](bench/results/{path.name}) (`bench/results/{path.name}`)")
    return "\n".join(rows)


def on_files(files: Any, config: Any) -> Any:
    """Add the benchmark reports (and their charts) to the site at ``bench/results/…``, outside
    the navigation: ``docs/benchmarks.md`` lists them (``render_reports``)."""
    from mkdocs.structure.files import File, InclusionLevel

    for path in sorted((REPO / RESULTS).iterdir()):
        if path.suffix in (".md", ".png"):
            report = File(
                str(RESULTS / path.name),
                src_dir=str(REPO),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
            report.inclusion = InclusionLevel.NOT_IN_NAV
            files.append(report)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the configuration page's tables; read a link to ``../bench/results/…`` (right on
    GitHub, from ``docs/``) as the report the site carries."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render_settings())
    if REPORTS_MARKER in markdown:
        markdown = markdown.replace(REPORTS_MARKER, render_reports())
    return markdown.replace("](../bench/results/", "](bench/results/")
