"""Run a Tessera service as a real subprocess, as `tessera up` does, and wait for it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from libs.runtime.procs import child_kwargs
from libs.runtime.servers import NatsServer, RedisServer

#: How a gateway exits on SIGTERM: uvicorn shuts down gracefully, then raises the signal again.
GATEWAY_STOPPED = (0, -signal.SIGTERM)

#: How often the telemetry agents of these tests report (s).
TELEMETRY_INTERVAL_S = 1.0


def service_env(nats: NatsServer, redis: RedisServer, prefix: str, **extra: str) -> dict[str, str]:
    """A service's environment on these servers, its Redis keys under ``prefix``."""
    return {
        "TESSERA_NATS_URL": nats.url,
        "TESSERA_REDIS_URL": redis.url,
        "TESSERA_SCORER_KEY_PREFIX": prefix,
        "TESSERA_TELEMETRY_INTERVAL_S": str(TELEMETRY_INTERVAL_S),
        **extra,
    }


class ServiceProcess:
    """``python -m services.<name>`` with extra environment; its JSON log lines are kept."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        argv: list[str] | None = None,
        ready: Any = None,
    ) -> None:
        self.name = name
        #: What runs after ``python``, and the log line that says it is up.
        self.argv = argv or ["-m", f"services.{name}"]
        self.ready = ready or (lambda e: e.get("msg") == "ready")
        self.env = {**os.environ, "TESSERA_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **env}
        self.lines: list[dict[str, Any]] = []
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 60.0) -> ServiceProcess:
        self.lines.clear()
        self._events = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, *self.argv],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **child_kwargs(),
        )
        threading.Thread(target=self._read, args=(self.process,), daemon=True).start()
        self.wait_for(self.ready, ready_timeout_s)
        return self

    def _read(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            try:
                entry = json.loads(raw)
            except ValueError:
                entry = {"msg": raw.decode(errors="replace").rstrip()}
            if isinstance(entry, dict):
                self.lines.append(entry)
                self._events.put(entry)

    def wait_for(self, match: Any, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                entry = self._events.get(timeout=0.1)
            except queue.Empty:
                if self.process is not None and self.process.poll() is not None:
                    break
                continue
            if match(entry):
                return entry
        tail = "\n".join(json.dumps(e) for e in self.lines[-30:])
        raise AssertionError(f"{self.name}: no matching log line within {timeout_s} s\n{tail}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None
