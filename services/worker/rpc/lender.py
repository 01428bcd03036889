"""A device lending its CPU and nothing else: the worker's ``RpcServer`` on this host, lent to
the heads named, until its standard input closes.

    python -m services.worker.rpc.lender HOST CREDENTIALS_FOLDER BINARIES THREADS HEADS

``CREDENTIALS_FOLDER`` empty: loopback only, no TLS; ``HEADS`` comma-separated device ids. It
prints ``{"endpoint", "local_port"}`` as one JSON line once it listens (the two-host tests and
``bench/rpc_channel.py`` start it through ``libs/harness/lan.lender``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from libs.runtime.pki import Credentials
from services.worker.rpc.server import RpcServer


async def main(argv: list[str]) -> None:
    host, folder, binaries, threads, heads = argv
    credentials = Credentials.in_folder(Path(folder)) if folder else None
    rpc = RpcServer(Path(binaries), host, threads=int(threads), credentials=credentials)
    await rpc.start()
    await rpc.lend_to(filter(None, heads.split(",")))
    print(json.dumps({"endpoint": rpc.endpoint, "local_port": rpc.local_port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await rpc.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:6]))
