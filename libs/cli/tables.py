"""Tables that fit the terminal: no cell is ever cut.

Each column has a priority (0 = always shown); when the table's natural width is more than the
terminal's, the columns of the highest priority number go first, and the table's caption says
which were left out and that ``--wide`` shows them. With ``wide`` every column is shown and
the table is printed at its natural width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


@dataclass(frozen=True)
class Column:
    header: str
    justify: Literal["left", "right"] = "right"
    #: 0: always shown; higher numbers are dropped first when the terminal is narrow.
    priority: int = 0


def build(
    title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], caption: str = ""
) -> Table:
    table = Table(
        title=title,
        caption=caption or None,
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption_justify="left",
    )
    for column in columns:
        table.add_column(column.header, justify=column.justify, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def natural_width(console: Console, table: Table) -> int:
    """The width the table takes with no column cut (not clamped to the terminal's)."""
    options = console.options.update(max_width=100_000)
    return Measurement.get(console, options, table).maximum


def fitted(
    console: Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    wide: bool = False,
) -> Table:
    """The table with as many columns as fit ``console``'s width (all of them when ``wide``)."""
    shown = list(range(len(columns)))
    dropped: list[int] = []
    while not wide:
        table = build(title, [columns[i] for i in shown], [[r[i] for i in shown] for r in rows])
        droppable = [i for i in shown if columns[i].priority > 0]
        if natural_width(console, table) <= console.width or not droppable:
            break
        last = max(droppable, key=lambda i: (columns[i].priority, i))
        shown.remove(last)
        dropped.append(last)
    caption = ""
    if dropped:
        names = ", ".join(columns[i].header for i in sorted(dropped))
        caption = f"not shown at {console.width} columns: {names} (--wide shows all)"
    return build(title, [columns[i] for i in shown], [[r[i] for i in shown] for r in rows], caption)


def show(
    title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], wide: bool = False
) -> None:
    """Print a fitted table; with ``wide``, at its full width whatever the terminal's."""
    console = Console()
    table = fitted(console, title, columns, rows, wide)
    if wide:
        console = Console(width=max(console.width, natural_width(console, table)))
    console.print(table)
