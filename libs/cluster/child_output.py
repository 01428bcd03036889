"""How a child process reads on the console: its JSON log lines as ``level msg key=value``
(``render``) and its exit in words (``exit_text``)."""

from __future__ import annotations

import signal

from libs.runtime.procs import Line


def exit_text(code: int | None) -> str:
    """A child's exit in words: still running (None), the signal that stopped it, or its code."""
    if code is None:
        return "still running"
    if code < 0:
        return f"stopped by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def render(line: Line) -> str:
    """A child's log line as ``level msg key=value`` (a plain line as it came)."""
    if set(line) == {"msg"}:
        return str(line["msg"])
    skip = {"ts", "level", "service", "logger", "msg"}
    extras = " ".join(f"{k}={v}" for k, v in line.items() if k not in skip)
    return f"{line.get('level', 'info'):<7} {line.get('msg', '')} {extras}".rstrip()
