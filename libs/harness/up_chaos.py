"""Faults as a user meets them: a running ``tessera up``, its real processes killed.

``UpChaos`` starts ``tessera up`` as a user would (a subprocess, on a home of its own, two
emulated devices and two workers serving SmolLM2, the restart policy ``on-failure``), drives
the chat load of ``chat_load.py`` through its gateway with clients that retry as OpenAI's
does, and injects one fault at a time once a third of the requests are done: SIGKILL of one
process (each service, the worker holding the model, Redis, nats-server, or one server of
three), or SIGKILL of every process of the cluster at once, as a power cut, followed by
``tessera up`` on the same home, as a boot would. Nothing here starts a killed process again:
``tessera up``'s supervision does (``libs/cluster/supervising.py``), or, after the power cut,
the new ``tessera up`` and what its home kept.

Each fault's ``Outcome`` counts the requests (``chat_load.py``), ``back_s`` (from the kill
until ``tessera up`` said the process is back; after a power cut, until it said ``ready``) and
``recovery_s`` (until that, and a fresh request streams its first token).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

from libs.cluster import runfile
from libs.harness.chaos_outcomes import Outcome
from libs.harness.chat_load import ChatLoad, load_env
from libs.harness.placement import model_devices
from libs.runtime.proc_tree import descendants, unit_pid
from libs.runtime.procs import Line, ServiceProcess, free_port

MODEL = "smollm2-135m-instruct"
#: Each service in turn, then the worker holding the model, the servers, and the power cut.
FAULTS = (
    "scorer_kill",
    "telemetry_kill",
    "scheduler_kill",
    "gateway_kill",
    "worker_kill",
    "redis_kill",
    "nats_kill",
    "power_cut",
)
#: With three nats-servers (``nats_servers=3``) the NATS fault kills one of them instead.
NATS_CLUSTER_FAULTS = ("nats_member_kill",)
#: How long a start of ``tessera up`` may take to say ``ready`` (deploying SmolLM2 included).
BOOT_TIMEOUT_S = 300.0


class UpChaos:
    def __init__(
        self,
        *,
        concurrency: int = 4,
        max_tokens: int = 8,
        interval_s: float = 1.0,
        nats_servers: int = 1,
        engine: str | None = None,
        retry_for_s: float = 120.0,
        log: TextIO | None = None,
    ) -> None:
        """``retry_for_s``: how long a client tries one request again (a power cut keeps the
        gateway away for as long as ``tessera up`` takes to start)."""
        self.interval_s, self.nats_servers = interval_s, nats_servers
        self.home = Path(tempfile.mkdtemp(prefix="tessera-chaos-home-"))
        self.run_file = self.home.with_name(self.home.name + "-run") / "cluster.json"
        self.run_file.parent.mkdir()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            "TESSERA_HOME": str(self.home),
            "TESSERA_RUN_FILE": str(self.run_file),
            "TESSERA_GATEWAY_PORT": str(port),
            "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
            **load_env(interval_s),
            "COLUMNS": "200",
        }
        self.argv = ["-m", "libs.cli.main", "up", "--devices", "2", "--workers", "2"]
        self.argv += ["--nats-servers", str(nats_servers), "--restart", "on-failure"]
        if engine is not None:
            self.argv += ["--engine", engine]
        self.log = log
        #: Every line ``tessera up`` printed, with when it was read (monotonic s).
        self.said: list[tuple[float, str]] = []
        self.up: ServiceProcess | None = None
        self.engine = ""
        self.chat = ChatLoad(self.url, MODEL, max_tokens, concurrency, retry_for_s)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._boot()
        self.chat.learn_answers()

    def stop(self) -> None:
        if self.up is not None:
            self.up.stop(timeout_s=60)
        shutil.rmtree(self.home, ignore_errors=True)
        shutil.rmtree(self.run_file.parent, ignore_errors=True)

    def _boot(self) -> float:
        """Start ``tessera up``; when it said ``ready`` (monotonic s)."""
        started = time.monotonic()
        self.up = ServiceProcess("tessera up", self.env, self.argv, on_line=self._heard)
        self.up.start(ready_timeout_s=None)
        said = self._wait_said("ready:", started, BOOT_TIMEOUT_S)
        # Said before `ready`, when it starts: which engine the CPU workers run.
        note = next((t.split("engines:", 1)[1] for at, t in self.said if "engines:" in t), "")
        self.engine = "llamacpp" if "llama" in note.split(";")[0] else "torch"
        return said

    def _heard(self, line: Line) -> None:
        text = str(line.get("msg", line))
        self.said.append((time.monotonic(), text))
        if self.log is not None:
            self.log.write(text + "\n")
            self.log.flush()

    def _wait_said(self, text: str, since: float, timeout_s: float) -> float:
        """When ``tessera up`` first said ``text`` after ``since`` (monotonic s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for at, said in list(self.said):
                if at >= since and text in said:
                    return at
            if time.monotonic() > deadline or (self.up is not None and not self.up.alive):
                tail = "\n".join(s for _, s in self.said[-40:])
                raise RuntimeError(f"tessera up did not say {text!r} in {timeout_s:.0f} s:\n{tail}")
            time.sleep(0.05)

    # -- one fault -----------------------------------------------------------------------------
    def run(self, fault: str, requests: int) -> Outcome:
        outcome = Outcome(fault)
        began = time.monotonic()
        third = threading.Event()
        load = threading.Thread(
            target=lambda: asyncio.run(self.chat.run(requests, outcome.counts, third)),
            daemon=True,
        )
        load.start()
        third.wait()
        at, back = self._inject(fault)
        outcome.back_s = back - at
        outcome.recovery_s = self._recover(at)
        load.join()
        outcome.elapsed_s = time.monotonic() - began
        return outcome

    def _inject(self, fault: str) -> tuple[float, float]:
        """Kill what ``fault`` names; (when, when it was back)."""
        assert self.up is not None and self.up.process is not None
        if fault == "power_cut":
            return self._power_cut()
        unit, port = self._unit(fault)
        pid = unit_pid(self.up.process.pid, unit, port)
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return at, self._wait_said(f"{unit} back after", at, 120.0)

    def _unit(self, fault: str) -> tuple[str, int | None]:
        """The process a kill fault aims at, as supervision names it, and (for one server of
        a NATS cluster) its port."""
        name = fault.removesuffix("_kill")
        if name == "worker":
            devices = model_devices(self.url, MODEL)
            if not devices:
                raise RuntimeError(f"{MODEL} is placed nowhere: no worker to kill")
            return devices[0], None
        if name == "nats_member":
            if self.nats_servers < 3:
                raise ValueError("nats_member_kill needs three nats-servers: --nats-servers 3")
            url = str(runfile.read(self.run_file)["nats_url"]).split(",")[0]
            return "nats-0", urlsplit(url).port
        if name == "nats" and self.nats_servers > 1:
            raise ValueError("with three nats-servers the NATS fault is nats_member_kill")
        known = (*FAULTS, *NATS_CLUSTER_FAULTS)
        if fault not in known:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(known)}")
        return name, None

    def _power_cut(self) -> tuple[float, float]:
        """SIGKILL every process of the cluster at once, then ``tessera up`` on its home."""
        assert self.up is not None and self.up.process is not None
        root = self.up.process.pid
        everyone = [root, *descendants(root)]
        at = time.monotonic()
        for pid in everyone:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self.up.process.wait(30)
        ready = self._boot()
        return at, ready

    def _recover(self, since: float) -> float | None:
        """Seconds from the fault until a fresh request streams its first token."""
        while time.monotonic() < since + 180:
            if asyncio.run(self.chat.streams_again()):
                return time.monotonic() - since
            time.sleep(0.1)
        return None
