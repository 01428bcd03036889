"""This device's CPU lent to llama.cpp: its ``ggml-rpc-server``, run for as long as the worker
lives.

A split across devices is llama.cpp's RPC backend driven by Tessera's placement: the first
shard's worker runs ``llama-server`` (``services/worker/served/llama_server.py``) with its own
layers on its CPU and the rest on the RPC servers of the other shards' devices. Every llamacpp
worker runs one ``RpcServer`` and announces its address (``rpc_endpoint``); between hosts it is
reached only through mutual TLS (``channel.py``), and it keeps the tensors it received in a
cache under a size limit (``cache.py``).

The binaries come from ``make llama`` (``deploy/build_llama.sh``) in ``.llama/``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable
from pathlib import Path

from libs.runtime.pki import Credentials
from libs.runtime.procs import child_kwargs, free_port, port_free
from services.worker.device.processes import EngineError, engine_env, stop_process
from services.worker.rpc.cache import rpc_cache_dir, trim
from services.worker.rpc.channel import (
    LOOPBACK,
    ChannelError,
    Listener,
    is_loopback,
    listener,
    listening,
)

log = logging.getLogger(__name__)

#: How long (spin iterations) an OpenMP thread of llama.cpp busy-waits for the next work before
#: it sleeps. libgomp's default, 300,000, keeps an idle thread spinning for milliseconds after
#: every graph: a split's stages then spin on the cores the stage at work needs (on one host),
#: and so do the worker, gateway and NATS beside them. 10,000 still spans the barriers inside a
#: graph (OMP_WAIT_POLICY=passive, which sleeps at each, cut one stream to a third). On 2
#: cores, 8 streams, llama-server direct split in 2: 130–145 → 170–183 tokens/s; through
#: Tessera, 0.63 → 0.84 × the whole model (bench/results/serving.md).
SPIN_COUNT = "10000"


def llama_env(gpu: bool = False) -> dict[str, str]:
    """The environment of llama.cpp's processes (a ``GOMP_SPINCOUNT`` already set is kept).
    Unless ``gpu``, a CUDA build sees no GPU and runs as the CPU build does: the RPC server and
    a split's head serve from the CPU, whose memory the placement counted."""
    env = engine_env()
    env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


#: What this host's RPC tensor cache may hold (``TESSERA_WORKER_RPC_CACHE_GB``).
DEFAULT_CACHE_BYTES = 20 * 10**9


class RpcServer:
    """This device's ``ggml-rpc-server``: its CPU (and, ``gpu``, its GPU after it: two
    devices, the shard's first layers on the CPU and its last on the GPU, as the placement
    counted them), lent to the llama-server of a placement.

    The server itself listens on 127.0.0.1 only. Lent to other hosts (``host`` not loopback),
    it is reached through a mutual-TLS listener on ``host:port`` that lets in only peers with
    a certificate of the cluster's CA naming a head it lends to (``lend_to``; none at first:
    ``channel.py``): ``credentials``, this device's own, are then
    required. The announced ``endpoint`` is that listener's."""

    def __init__(
        self,
        binaries: Path,
        host: str,
        port: int = 0,
        threads: int = 1,
        credentials: Credentials | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        announce: str | None = None,
        gpu: bool = False,
    ) -> None:
        self.binaries, self.host, self.threads, self.gpu = binaries, host, threads, gpu
        #: Where others reach it, where that is not ``host:port`` (a relay in front of it).
        self.announce = announce
        self.credentials, self.cache_bytes = credentials, cache_bytes
        self.port = port or free_port(host)
        while not port and not is_loopback(host) and not port_free(LOOPBACK, self.port):
            self.port = free_port(host)
        #: The server's own port, on loopback: the TLS listener's number, so that a head on
        #: this same host reaches it there directly (``channel.open_tunnels``).
        self.local_port = self.port
        self.proc: asyncio.subprocess.Process | None = None
        self.listener: Listener | None = None

    def command(self, binary: Path) -> tuple[list[str], dict[str, str]]:
        """The server's command and environment: its CPU, or, ``gpu``, its CPU then its GPU
        (the head names them RPCn and RPCn+1 in that order: ``llama_server.gpu_command``)."""
        command = [
            *(str(binary), "-H", LOOPBACK, "-p", str(self.local_port), "-t", str(self.threads)),
            # Keep received tensors in a file cache by hash (under LLAMA_CACHE): a head that
            # places the same model here again sends hashes, not weights (tensors over 10 MiB);
            # the least recently used are removed before a start beyond ``cache_bytes``.
            "-c",
            *(("-d", "CPU,CUDA0") if self.gpu else ()),
        ]
        return command, {**llama_env(gpu=self.gpu), "LLAMA_CACHE": str(rpc_cache_dir())}

    @property
    def endpoint(self) -> str:
        """Its address as announced: ``announce``, else where its listener is."""
        return self.announce or f"{self.host}:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> None:
        binary = self.binaries / "ggml-rpc-server"
        if not binary.exists():
            raise EngineError(f"{binary} not found: build it with `make llama`")
        if not is_loopback(self.host) and self.credentials is None:
            raise EngineError(
                f"llama.cpp's RPC server would be reachable on {self.host} without "
                "authentication: it needs this device's cluster certificate (tessera join)"
            )
        await asyncio.to_thread(trim, rpc_cache_dir(), self.cache_bytes)
        command, env = self.command(binary)
        self.proc = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
            **child_kwargs(signal.SIGKILL),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise EngineError(f"ggml-rpc-server exited with {self.proc.returncode}")
            if listening(self.local_port):
                break
            await asyncio.sleep(0.1)
        else:
            await self.stop()
            raise EngineError(
                f"ggml-rpc-server did not listen on {self.local_port} in {timeout_s} s"
            )
        if self.credentials is not None and not is_loopback(self.host):
            try:
                relay = listener(self.credentials, self.host, self.port, self.local_port)
                self.listener = await relay.start(timeout_s)
            except ChannelError as exc:
                await self.stop()
                raise EngineError(f"the RPC server's TLS listener: {exc}") from exc
        log.info("rpc server up", extra={"endpoint": self.endpoint, "tls": bool(self.listener)})

    async def lend_to(self, heads: Iterable[str]) -> None:
        """Let only these devices (the heads of the placements it lends to) through the TLS
        listener from now on; a head no longer named loses its connections."""
        if self.listener is not None:
            await self.listener.admit(heads)

    async def stop(self) -> None:
        relay, self.listener = self.listener, None
        if relay is not None:
            await relay.stop()
        proc, self.proc = self.proc, None
        await stop_process(proc, 5.0)
