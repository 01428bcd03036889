"""How `tessera up` and `tessera join` are told to stop, and asked where they are."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
from collections.abc import Iterator
from types import FrameType


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within: SIGTERM and Ctrl-C (SIGINT) raise ``KeyboardInterrupt`` in the main thread, and
    ``kill -USR1`` prints every thread's stack. SIGINT is set even when it was ignored where
    the command started (a script's `cmd &`, nohup: an ignored signal is inherited, and Python
    leaves it ignored). The previous handlers come back on the way out."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    interrupted = signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # no stderr to write to
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, interrupted)
