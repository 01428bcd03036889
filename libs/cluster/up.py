"""``tessera up`` in the foreground: start the cluster, deploy the models, watch it.

Prints one ``ready`` line once every service is up and the models are deployed. A service that
exits is reported and brings the cluster down (nothing is restarted silently), except a worker:
a worker is a device, and losing one is a failure the cluster survives. Ctrl-C or SIGTERM stops
every child, then the servers.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from types import FrameType

from rich.console import Console

from libs.cluster.launcher import Cluster, UpOptions, exit_text


def deploy_model(options: UpOptions, model: str, timeout_s: float = 60.0) -> str:
    """Ask the scheduler to deploy ``model`` under its own name (retried while workers join)."""
    url = f"http://127.0.0.1:{options.scheduler_port}/placements"
    body = json.dumps({"model": model, "deployment_id": model}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            url, body, headers={"content-type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                placed = json.loads(response.read())
                devices = [a["device_id"] for a in placed["assignments"]]
                return f"deployed {model} on {', '.join(devices)}"
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")[:300]
        except OSError as exc:
            last = str(exc)
        time.sleep(1.0)
    return f"could not deploy {model}: {last}"


def run_cluster(options: UpOptions, console: Console | None = None) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until a service dies (exit 1)."""
    cluster = Cluster(options, console)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        cluster.start()
        if not cluster.wait_ready():
            dead = cluster.first_exited()
            why = f"{dead.name} {exit_text(dead.returncode)}" if dead else "timeout"
            cluster.say("cluster", f"failed to start: {why}", "bold red")
            return 1
        url = f"http://{options.gateway_host}:{options.gateway_port}"
        has_workers = any(cluster.is_worker(c) for c in cluster.children)
        for model in options.deploy if has_workers else ():
            cluster.say("cluster", deploy_model(options, model), "white")
        names = ", ".join(c.name for c in cluster.children) or "no services"
        if options.run_file is not None and options.run_file.name != "cluster.json":
            note = f"another cluster runs here; for this one: TESSERA_RUN_FILE={options.run_file}"
            cluster.say("cluster", note, "bold yellow")
        ready = f"ready: {names}; gateway {url} (OpenAI API {url}/v1, dashboard {url}/)"
        cluster.say("cluster", ready, "bold green")
        lost: set[str] = set()
        while True:
            for worker in cluster.exited_workers() - lost:
                lost.add(worker)  # a worker is a device: losing one is a failure to survive
                cluster.say("cluster", f"{worker} exited: its device is lost", "bold yellow")
            dead = cluster.first_exited(essential=True)
            if dead is not None:
                why = exit_text(dead.returncode)
                cluster.say("cluster", f"{dead.name} {why} unexpectedly; stopping", "bold red")
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        cluster.say("cluster", "stopping", "white")
        return 0
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
