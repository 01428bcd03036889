"""A TCP relay that holds every byte for a fixed time each way: the delay of a slow link
(this kernel has no ``netem``, so the link of an emulated device gets its round trip here, in
user space, while ``tc`` holds its bandwidth: ``libs/cluster/links.py``).

Each direction is a reader and a writer: the reader stamps each chunk with the time it is due
(arrival + ``one_way_ms``) and queues it; the writer sends it once due. Chunks keep their order
and the link's throughput is not cut (a chunk waits its delay while the next is read), so a
request and its answer cross it ``2 × one_way_ms`` later than without it, whatever their size.

``python -m libs.cluster.relay LISTEN_HOST TARGET_HOST:PORT ONE_WAY_MS`` listens on a free port
of ``LISTEN_HOST``, prints ``{"port": N}`` once it does, and relays until its standard input
closes (its parent went) or it is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time

CHUNK = 64 * 1024


async def _carry(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float
) -> None:
    """Bytes from ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived."""
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(CHUNK):
            due.put_nowait((time.monotonic() + delay_s, data))
        due.put_nowait((time.monotonic() + delay_s, b""))  # the end, delayed as data is

    async def write() -> None:
        while True:
            at, data = await due.get()
            if (wait := at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()


class DelayRelay:
    """Connections to ``listen_host`` (a free port) relayed to ``target``, ``one_way_ms`` late
    each way."""

    def __init__(self, listen_host: str, target: tuple[str, int], one_way_ms: float) -> None:
        if one_way_ms < 0:
            raise ValueError(f"a delay cannot be negative: {one_way_ms} ms")
        self.listen_host, self.target, self.delay_s = listen_host, target, one_way_ms / 1000.0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, self.listen_host, 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(
                _carry(client_r, server_w, self.delay_s),
                _carry(server_r, client_w, self.delay_s),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass  # either end went: both are closed below
        except asyncio.CancelledError:
            pass  # the relay's loop ends: the connection with it (nobody awaits this task)
        finally:
            for w in (client_w, server_w):
                w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _main(listen_host: str, target: str, one_way_ms: float) -> None:
    host, _, port = target.rpartition(":")
    relay = DelayRelay(listen_host, (host, int(port)), one_way_ms)
    print(json.dumps({"port": await relay.start()}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def on_stdin() -> None:
        if not os.read(sys.stdin.fileno(), 4096):  # closed: the parent went
            stop.set()

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    await stop.wait()
    await relay.close()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
