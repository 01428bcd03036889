"""``tessera up``: the whole cluster on this machine as child processes. Starts an embedded
nats-server and redis-server, then every service that exists (``services/<name>/__main__.py``)
with the shared environment, prints their logs with a coloured prefix, waits until each has
logged ``ready`` (and the gateway answers /healthz), and stops them all, children first.
``libs/cluster/up.py`` runs it in the foreground; what it starts is ``UpOptions``."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
import urllib.request

from rich.console import Console
from rich.text import Text

from libs.cluster import runfile
from libs.cluster.access import REDIS_USERS, AccessControl
from libs.cluster.batch_env import batch_env
from libs.cluster.child_output import exit_text, render
from libs.cluster.discovery import Announcement
from libs.cluster.enforced import EnforcedFleet
from libs.cluster.home import Home, open_home
from libs.cluster.joining import JoinDesk
from libs.cluster.prometheus_config import write_prometheus_config
from libs.cluster.servers import HOST, NatsCluster, RedisServer
from libs.cluster.shipped_model import register_shipped_model
from libs.cluster.up_options import (
    UpOptions,
    available_services,
    choose_port,
    join_commands,
    lan_exposure,
)
from libs.runtime.api_keys import read_keys
from libs.runtime.pki import ClusterCA, rpc_env
from libs.runtime.procs import ServiceProcess, free_port
from libs.runtime.settings import child_env

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan")


class Cluster:
    """The local cluster's servers and child processes: started in order, watched, restarted
    one at a time (``respawn``) and stopped children first."""

    def __init__(self, options: UpOptions, console: Console | None = None) -> None:
        self.options = options
        self.console = console or Console(highlight=False)
        #: The home's lock (``Home.lock``), held until ``stop``; what opening the home did.
        self.home: Home | None = None
        self.home_lock: int | None = None
        self.home_notes: list[str] = []
        if options.home is not None:
            self.home, self.home_lock, self.home_notes = open_home(options.home, options.fresh)
        #: The gateway's keys: the home's, and one of this run's for ``tessera up``'s own first
        #: request (kept in the children's environment only).
        self.keys_file = (
            self.home.keys_file if self.home and read_keys(self.home.keys_file) else None
        )
        self.run_key = f"tsk-run-{secrets.token_urlsafe(24)}"
        self.batch = f"tsk-batch-{secrets.token_urlsafe(24)}"  # the batch runner's: batch_env
        given = "TESSERA_GATEWAY_API_KEYS" in {**child_env(), **options.extra_env}
        warning = lan_exposure(
            options.gateway_host, given or self.keys_file is not None, options.open_lan
        )
        self.home_notes += [warning] if warning else []
        #: The fleet file's workers held to their devices' size (None: none listed).
        self.enforced = EnforcedFleet.read(options.fleet, secrets.token_hex(3))
        workers = [name for name, _ in self.worker_names()]
        self.access = (
            AccessControl(workers, path=self.home.access_file if self.home else None)
            if options.access
            else None
        )
        self.nats = NatsCluster(
            options.nats_servers,
            host=options.listen or HOST,
            first_port=self._nats_port(),
            tls=options.nats_tls,
            data_dir=self.home.nats_dir if self.home else None,
        )
        self.desk: JoinDesk | None = None
        self.announcement: Announcement | None = None
        self.redis = RedisServer(
            acl=self.access.redis_acl() if self.access else None,
            data_dir=self.home.redis_dir if self.home else None,
        )
        if self.access is not None:
            self.nats.config = self.access.write_nats_config(self.nats.data_dir / "nats.conf")
        #: Signs certificates for llama.cpp's RPC between hosts and to a fleet's linked workers
        #: (libs/runtime/pki.py), kept in the home, else beside the NATS users.
        beyond = options.listen or (self.enforced is not None and self.enforced.links)
        self.rpc_ca = self._rpc_ca() if options.access and beyond else None
        self.children: list[ServiceProcess] = []
        #: The run file's locked descriptor, held until ``stop`` (``libs/cluster/runfile.py``),
        #: and what it holds.
        self.run_lock: int | None = None
        self.run_contents: dict[str, object] = {}
        self.colours: dict[str, str] = {}
        self._stopping = False
        #: Ports of the services that serve /metrics on a port of their own.
        self.metrics_ports = {name: free_port() for name in ("scorer", "telemetry", *workers)}
        others = {f"scheduler-{i}": free_port() for i in range(1, options.scheduler_replicas)}
        self.scheduler_ports = {"scheduler": options.scheduler_port, **others}

    def _nats_port(self) -> int | None:
        """With ``--listen``: the home's kept port (``Home.nats_port``); None: any free."""
        if not self.options.listen:
            return None
        if self.home is None:
            return choose_port(self.options.listen, 4222)
        port, note = self.home.nats_port(self.options.listen)
        self.home_notes += [note] if note else []
        return port

    def _rpc_ca(self) -> ClusterCA:
        if self.home is None:
            return ClusterCA.create(self.nats.data_dir / "rpc-ca")
        return ClusterCA.kept_in(self.home.rpc_ca_dir)

    @property
    def scheduler_urls(self) -> list[str]:
        """Each scheduler replica's HTTP address (only the leader's listens)."""
        return [f"http://127.0.0.1:{p}" for p in self.scheduler_ports.values()]

    # -- environment shared by every child ------------------------------------------------
    def child_env(self) -> dict[str, str]:
        env = child_env()
        env.update(
            TESSERA_NATS_URL=self.nats.url,
            TESSERA_REDIS_URL=self.redis.url,
            TESSERA_GATEWAY_HOST=self.options.gateway_host,
            TESSERA_GATEWAY_PORT=str(self.options.gateway_port),
            TESSERA_TELEMETRY_DEVICES=str(self.options.devices),
            TESSERA_SCHEDULER_HTTP_PORT=str(self.options.scheduler_port),
            TESSERA_GATEWAY_SCHEDULER_URL=",".join(self.scheduler_urls),
            TESSERA_SCORER_METRICS_PORT=str(self.metrics_ports["scorer"]),
            TESSERA_TELEMETRY_METRICS_PORT=str(self.metrics_ports["telemetry"]),
            TESSERA_LOG_FORMAT="json",
            PYTHONUNBUFFERED="1",
        )
        if self.home is not None:
            env.setdefault(
                "TESSERA_GATEWAY_ACCESS_LOG", str(self.home.path / "logs" / "access.log")
            )
        if self.keys_file is not None:  # the home's keys, and this run's own
            env["TESSERA_GATEWAY_KEYS_FILE"] = str(self.keys_file)
            env.setdefault("TESSERA_GATEWAY_API_KEYS", json.dumps([self.run_key]))
        # Open only when no key exists: on loopback, or on the LAN with --open (lan_exposure).
        env.setdefault(
            "TESSERA_GATEWAY_AUTH", "keys" if "TESSERA_GATEWAY_API_KEYS" in env else "off"
        )
        if self.options.fleet is not None:
            env["TESSERA_TELEMETRY_FLEET"] = str(self.options.fleet)
        if self.options.nats_ca is not None:
            env["TESSERA_NATS_CA"] = str(self.options.nats_ca)
        env.update(self.options.extra_env)
        return env

    def urls(self, user: str) -> dict[str, str]:
        """NATS and Redis URLs with ``user``'s credentials (plain ones without access control)."""
        if self.access is None:
            return {"nats": self.nats.url, "redis": self.redis.url}
        redis_user = user if user in REDIS_USERS else None
        return {
            "nats": self.access.nats_url(self.nats.url, user),
            "redis": self.access.redis_url(self.redis.url, redis_user) if redis_user else "",
        }

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._deadline = time.monotonic() + self.options.ready_timeout_s
        self.nats.start()
        self.redis.start()
        for note in self.home_notes:
            self.say("cluster", note, "white")
        self.say("cluster", f"nats {self.nats.url}, redis {self.redis.url}", "white")
        if self.options.engines_note:
            self.say("cluster", f"engines: {self.options.engines_note}", "white")
        self._write_run_file()
        self._register_shipped()
        if self.options.listen and self.access is not None:
            admin = self.urls("admin")["nats"]
            self.desk = JoinDesk(
                self.access, self.nats, admin, self.options.nats_ca, self.rpc_ca
            ).start()
            for said in join_commands(self.nats.url, self.access.token, self.options.nats_ca):
                self.say("cluster", said, "white")
            try:
                self.announcement = Announcement(self.nats.url)
                self.say("cluster", "announced on the LAN (mDNS): the URL may be left out", "white")
            except Exception as exc:  # the cluster works without it: say so and go on
                self.say("cluster", f"not announced on the LAN (mDNS): {exc!r}", "bold yellow")
        if self.enforced:
            self.enforced.start(lambda said: self.say("cluster", said, "white"), self.nats.url)
        for index, (name, service, extra) in enumerate(self.planned()):
            child = self._spawn(name, service, extra, COLOURS[index % len(COLOURS)])
            self.children.append(child)
            # In order: a consumer is listening before its producers start.
            if not self._wait_child(child):
                return

    def _register_shipped(self) -> None:
        """The model shipped in its PyPI package joins the registry (``register_shipped_model``),
        tried again until this start's deadline, for up to ``REGISTER_WAIT_S``."""
        register_shipped_model(
            self.urls("admin"),
            self.child_env().get("TESSERA_KEY_PREFIX", "tessera"),
            self.options.nats_ca,
            self._deadline,
            self.say,
        )

    def _spawn(self, name: str, service: str, extra: dict[str, str], colour: str) -> ServiceProcess:
        user = "batch" if service == "batch.worker" else service  # replicas: "scheduler"
        urls = self.urls(name if self.is_worker_name(name) else user)
        nats_url = self.enforced.nats_url(name, urls["nats"]) if self.enforced else urls["nats"]
        access = {"TESSERA_NATS_URL": nats_url}  # a linked worker's through its link
        if urls["redis"]:
            access["TESSERA_REDIS_URL"] = urls["redis"]
        self.colours[name] = colour
        child = ServiceProcess(
            name,
            {**self.child_env(), **access, **extra},
            ["-m", f"services.{service}"],
            on_line=lambda line: self.say(name, render(line), colour),
            prefix=self.enforced.prefix(name) if self.enforced else (),
        )
        return child.start(ready_timeout_s=None)

    def child(self, name: str) -> ServiceProcess:
        return next(c for c in self.children if c.name == name)

    def respawn(self, name: str, timeout_s: float = 120.0) -> bool:
        """Start ``name`` again after it exited (the chaos harness's restart); True once ready."""
        old = self.child(name)
        if old.alive:
            raise RuntimeError(f"{name} is still running")
        _, service, extra = next(p for p in self.planned() if p[0] == name)
        new = self._spawn(name, service, extra, self.colours[name])
        self.children[self.children.index(old)] = new
        self._deadline = time.monotonic() + timeout_s
        return self._wait_child(new)

    def planned(self) -> list[tuple[str, str, dict[str, str]]]:
        """(child name, service, extra environment) in start order; one child per worker."""
        out: list[tuple[str, str, dict[str, str]]] = []
        for service in available_services():
            if service == "scheduler":
                for name, port in self.scheduler_ports.items():
                    http = {"TESSERA_SCHEDULER_HTTP_PORT": str(port)}
                    out.append((name, service, {"TESSERA_SCHEDULER_REPLICA": name, **http}))
                continue
            if service != "worker":
                redis, access = self.redis.url, self.access
                extra = batch_env(service, self.options, redis, access, self.batch, self.home)
                out.append((service.replace(".", "-"), service, extra))
                continue
            torch_workers = sum(e == "torch" for _, e in self.worker_names())
            threads = max(1, (os.cpu_count() or 1) // max(1, torch_workers))
            for i, (name, engine) in enumerate(self.worker_names()):
                port = self.metrics_ports[name]
                env = {
                    "TESSERA_WORKER_DEVICE_ID": name,
                    "TESSERA_WORKER_ENGINE": engine,
                    "TESSERA_WORKER_PRELOAD": "true",  # a warm standby for failover
                    "TESSERA_WORKER_SEED": str(i),
                    "TESSERA_WORKER_METRICS_PORT": str(port),
                    # torch workers share this machine's cores
                    "OMP_NUM_THREADS": child_env().get("OMP_NUM_THREADS", str(threads)),
                    **(self.enforced.env(name) if self.enforced else {}),  # its size, if held
                }
                if engine == "llamacpp" and self.options.listen:  # joined heads reach it there
                    env["TESSERA_WORKER_RPC_HOST"] = self.options.listen
                if engine == "llamacpp" and self.rpc_ca is not None:  # through mutual TLS only
                    folder = self.nats.data_dir / "rpc" / name
                    env.update(rpc_env(self.rpc_ca.issue(folder, name)))
                out.append((name, service, env))
        return out

    def worker_names(self) -> list[tuple[str, str]]:
        """(device id, engine) of each worker: CPU workers, then vLLM ones."""
        engine = self.options.cpu_engine
        cpu = [(f"worker-{i}", engine) for i in range(self.options.workers)]
        cpu = self.enforced.names(engine) if self.enforced else cpu
        return cpu + [(f"vllm-{i}", "vllm") for i in range(self.options.vllm_workers)]

    def _standby_exists(self, child: ServiceProcess) -> bool:
        """A scheduler replica may exit while another one runs: it takes over."""
        replicas = [c for c in self.children if c.name in self.scheduler_ports]
        return child in replicas and any(c.alive for c in replicas)

    def is_worker(self, child: ServiceProcess) -> bool:
        return self.is_worker_name(child.name)

    def is_worker_name(self, name: str) -> bool:
        return name in dict(self.worker_names())

    def _wait_child(self, child: ServiceProcess) -> bool:
        return child.wait_ready(max(0.0, self._deadline - time.monotonic()))

    def wait_ready(self) -> bool:
        started = len(self.children) == len(self.planned())  # else start() returned early
        if not started or not all(self._wait_child(c) for c in self.children):
            return False
        return self._gateway_healthy(self._deadline) if self.has("gateway") else True

    def has(self, name: str) -> bool:
        return any(c.name == name for c in self.children)

    def _gateway_healthy(self, deadline: float) -> bool:
        url = f"http://{self.options.gateway_host}:{self.options.gateway_port}/healthz"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return True
            time.sleep(0.1)
        return False

    def first_exited(self, essential: bool = False) -> ServiceProcess | None:
        """The first child that exited (with ``essential``, workers do not count)."""
        for child in self.children:
            if essential and (self.is_worker(child) or self._standby_exists(child)):
                continue
            if not child.alive:
                return child
        return None

    def exited_workers(self) -> set[str]:
        return {c.name for c in self.children if self.is_worker(c) and not c.alive}

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for child in reversed(self.children):
            child.terminate()
        for child in reversed(self.children):
            code = child.stop(timeout_s=15)
            if code is not None:
                self.say(child.name, exit_text(code), self.colours[child.name])
        if self.enforced:
            self.enforced.stop()
        if self.announcement is not None:
            self.announcement.close()
        if self.desk is not None:
            self.desk.close()
        self.nats.close()
        self.redis.close()
        if self.options.run_file is not None and self.run_lock is not None:
            runfile.release(self.options.run_file, self.run_lock)
            self.run_lock = None
        if self.home_lock is not None:
            os.close(self.home_lock)
            self.home_lock = None

    def _write_run_file(self) -> None:
        """Tell `tessera devices` and friends where this cluster's servers listen."""
        if self.options.run_file is None:
            return
        # Locked for the cluster's life: a file no one holds is stale, whatever its pid says.
        self.options.run_file, self.run_lock = runfile.claim(self.options.run_file)
        url = f"http://{self.options.gateway_host}:{self.options.gateway_port}"
        admin = self.urls("admin")
        self.run_contents = {
            "nats_url": admin["nats"],
            "nats_ca": str(self.options.nats_ca) if self.options.nats_ca else None,
            "redis_url": admin["redis"],
            "gateway_url": url,
            "scheduler_url": f"http://127.0.0.1:{self.options.scheduler_port}",
            "metrics": self.metrics_targets(),
            "pid": os.getpid(),
        }
        runfile.write(self.run_lock, self.run_contents)
        prometheus = self.options.run_file.with_name(
            self.options.run_file.stem.replace("cluster", "prometheus") + ".yml"
        )
        write_prometheus_config(prometheus, self.metrics_targets())

    def record_services(self, services: dict[str, dict[str, object]]) -> None:
        """What each service is doing (running, restarting, failed), for ``tessera status``."""
        if self.run_lock is not None:
            self.run_contents["services"] = services
            runfile.write(self.run_lock, self.run_contents)

    def metrics_targets(self) -> dict[str, str]:
        """host:port of every service's /metrics."""
        targets = {n: f"127.0.0.1:{p}" for n, p in self.metrics_ports.items()}
        targets.update({n: f"127.0.0.1:{p}" for n, p in self.scheduler_ports.items()})
        targets["gateway"] = f"{self.options.gateway_host}:{self.options.gateway_port}"
        return targets

    # -- output -------------------------------------------------------------------------------
    def say(self, name: str, message: str, colour: str) -> None:
        self.console.print(Text(f"{name:>10} │ ", style=colour).append(message), soft_wrap=True)
