"""A benchmark's report, ``bench/results/<name>.md``: each run adds a section at the top (the
command, the date, the machine, the table), and the runs before it stay below, as they were
(the docs cite them).

Every benchmark calls ``add_results_option`` on its parser and ``write_report`` with what it
printed; ``--results DIR`` writes the report elsewhere (the tests' runs of the benchmarks do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

Row = Mapping[str, object]


def add_results_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="the folder the report goes to (default: bench/results)",
    )


def machine() -> str:
    """This machine in a line: its CPU, cores, memory and system (no host name)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        memory = f", {memory_gb:.1f} GB of memory"
    except (ValueError, OSError):
        memory = ""
    return (
        f"{cpu}, {os.cpu_count()} cores{memory}; {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def command(argv: Sequence[str] | None = None) -> str:
    """The command that ran this benchmark, as one would type it (without ``--results``)."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0])
    shown = f"bench/{script.name}" if script.parent.name == "bench" else str(script)
    kept: list[str] = []
    skip = False
    for arg in args[1:]:
        if skip:
            skip = False
        elif arg == "--results":
            skip = True
        elif not arg.startswith("--results="):
            kept.append(arg)
    return shlex.join(["python", shown, *kept])


def flatten(report: Mapping[str, object], prefix: str = "") -> list[tuple[str, object]]:
    """``report``'s figures as (dotted name, value) pairs, nested objects opened."""
    pairs: list[tuple[str, object]] = []
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            pairs += flatten(value, f"{name}.")
        else:
            pairs.append((name, value))
    return pairs


def cell(value: object) -> str:
    """A value as the JSON report prints it (true, null, 1.5), lists joined by commas."""
    if isinstance(value, list | tuple):
        text = ", ".join(cell(v) for v in value)
    elif isinstance(value, bool | None | float | int):
        text = json.dumps(value)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: Sequence[Row] | Mapping[str, object]) -> str:
    """A Markdown table: of ``rows`` (one column per key, in order of first appearance), or of
    one report's figures (``flatten``: a row per figure)."""
    if isinstance(rows, Mapping):
        rows = [{"figure": name, "value": value} for name, value in flatten(rows)]
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = [
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(
    folder: Path,
    name: str,
    title: str,
    body: str,
    *,
    replace: bool = False,
    argv: Sequence[str] | None = None,
) -> Path:
    """Add this run to ``folder/<name>.md``, under ``# title``: the command, the date, the
    machine, then ``body`` (a ``table``, and whatever the benchmark says about it). The runs
    already there stay below it, unless ``replace`` (a report that is its own whole document,
    written anew each time). Returns the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    heading = f"# {title}\n\n"
    earlier = "" if replace or not path.exists() else path.read_text()
    if earlier.startswith("# "):  # the title line, whatever it said: this run's replaces it
        earlier = earlier.split("\n", 1)[1].lstrip("\n") if "\n" in earlier else ""
    section = (
        f"## {time.strftime('%Y-%m-%d %H:%M')}: `{command(argv)}`\n\n"
        f"Machine: {machine()}.\n\n{body.strip()}\n\n"
    )
    path.write_text(heading + section + earlier)
    return path
