"""Serve a FastAPI app inside a service's own event loop (which owns the signals)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal capture: the service's lifecycle stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def start_http(
    app: FastAPI, host: str, port: int
) -> tuple[EmbeddedServer, asyncio.Task[None]]:
    """Start serving; returns once listening. Raises ``RuntimeError`` if it cannot bind."""
    server = EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_config=None))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError(f"HTTP server on {host}:{port} failed to start")
        await asyncio.sleep(0.02)
    return server, task


async def stop_http(server: EmbeddedServer, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    with contextlib.suppress(Exception):
        await task
