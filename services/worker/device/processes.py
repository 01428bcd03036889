"""What an engine run as a process of its own needs, whichever it is (a vLLM or llama.cpp
server, llama.cpp's RPC server): the error it starts with, its environment, and its stop."""

from __future__ import annotations

import asyncio

from libs.runtime.settings import child_env


class EngineError(RuntimeError):
    """An engine's process could not start, or stopped answering; the message says why."""


async def stop_process(proc: asyncio.subprocess.Process | None, timeout_s: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited after ``timeout_s``."""
    if proc is None or proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def engine_env(**extra: str) -> dict[str, str]:
    """An engine process's environment: this one's without Tessera's settings (an engine
    needs none, and a process carrying ``TESSERA_WORKER_DEVICE_ID`` looks like the worker)."""
    return {k: v for k, v in child_env(**extra).items() if not k.startswith("TESSERA_")}
