"""``tessera up`` in the foreground: start the cluster, deploy the models, watch it.

Prints one ``ready`` line once every service is up and every deployed model serves (its
workers said so; their loading progress is printed meanwhile, a refusal with its reasons) and
has answered a request through the gateway (so the first user request finds its shards loaded
and warm, not a placement still on its way). A service that exits is started again, said on the
console and kept in the run file for ``tessera status`` (``supervising.py``); with ``--restart no``
one that exits brings the cluster down instead, except a worker: a worker is a device, and
losing one is a failure the cluster survives. Ctrl-C or SIGTERM stops every child, then the
servers.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from libs.cluster.child_output import exit_text
from libs.cluster.joining import say_left
from libs.cluster.launcher import Cluster
from libs.cluster.stopping import stopped_by_signals
from libs.cluster.supervising import supervise
from libs.cluster.up_options import StartRefused, UpOptions
from libs.deployments import phases


def post_until_answered(
    url: str,
    body: dict[str, Any],
    timeout_s: float,
    pause_s: float,
    headers: dict[str, str] | None = None,
    final: Callable[[], bool] = lambda: False,
) -> tuple[Any, str]:
    """POST ``body`` as JSON until a 2xx answer (retried while services join or load, until
    ``final`` says a refusal will not change); the answer's JSON, or None and the last error."""
    deadline = time.monotonic() + timeout_s
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    last = ""
    while time.monotonic() < deadline:
        request = urllib.request.Request(url, data, headers, method="POST")
        try:
            left = max(1.0, deadline - time.monotonic())
            with urllib.request.urlopen(request, timeout=left) as response:
                return json.loads(response.read()), ""
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")[:300]
            if final():
                break
        except OSError as exc:
            last = str(exc)
        time.sleep(pause_s)
    return None, last


def scheduler_devices(options: UpOptions) -> set[str]:
    """The devices the scheduler places on now (none while it cannot be asked)."""
    url = f"http://127.0.0.1:{options.scheduler_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return set(json.loads(response.read()).get("devices", ()))
    except (OSError, ValueError):
        return set()


#: Phases after which a deployment's status changes no more by itself.
FINAL_PHASES = frozenset({"serving", "refused", "failed", "removed"})


def get_json(url: str, timeout_s: float = 5.0) -> Any:
    """``GET url``'s JSON; raises ``OSError`` (``HTTPError`` included) or ``ValueError``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def follow_deployment(
    base_url: str,
    deployment_id: str,
    timeout_s: float,
    pause_s: float = 0.5,
    on_change: Callable[[dict[str, Any]], None] = lambda status: None,
) -> dict[str, Any] | None:
    """Ask ``GET {base_url}/placements/{deployment_id}`` (the scheduler's, or the gateway's
    ``/v1/cluster`` proxy) until the deployment's phase is final (serving, refused, failed;
    ``removed`` when it is gone after being seen) or ``timeout_s`` passes; ``on_change`` gets
    each status whose phase or progress changed. Returns the last status read (None: none).
    Errors while the scheduler is away (a restart, a new leader) are waited out."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    url = f"{base_url}/placements/{deployment_id}"
    while True:
        try:
            status = get_json(url)
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or last is None:
                status = None
            else:  # seen, and now gone: undeployed meanwhile
                status = {**last, "phase": "removed", "reason": "undeployed"}
        except (OSError, ValueError):
            status = None
        if isinstance(status, dict) and "phase" in status:
            key = (status["phase"], status.get("progress"))
            if last is None or key != (last["phase"], last.get("progress")):
                on_change(status)
            last = status
            if status["phase"] in FINAL_PHASES:
                return last
        if time.monotonic() >= deadline:
            return last
        time.sleep(pause_s)


def phase_text(deployment_id: str, status: dict[str, Any] | None, timeout_s: float) -> str:
    """One line for where ``status`` left a deployment."""
    if status is None:
        return f"{deployment_id}: no status from the scheduler within {timeout_s:.0f} s"
    phase, reason = status["phase"], status.get("reason")
    devices = ", ".join(s["device_id"] for s in status.get("shards", ()))
    if phase == "serving":
        return f"{deployment_id} serving on {devices}"
    if phase in FINAL_PHASES:
        return f"{deployment_id} {phase}: {reason or 'no reason given'}"
    done = f"{status.get('progress', 0.0) * 100:.0f} %"
    return f"{deployment_id} still {phase} ({done}) after {timeout_s:.0f} s"


def deploy_model(
    options: UpOptions,
    model: str,
    workers: Sequence[str] = (),
    timeout_s: float = 60.0,
    settle_s: float = 5.0,
    load_timeout_s: float = 300.0,
    say: Callable[[str], None] = lambda line: None,
) -> str:
    """Ask the scheduler to deploy ``model`` under its own name (dots made dashes), retried
    while ``workers`` join (a refusal that holds ``settle_s`` after the scheduler sees them
    all is final), then follow it until it serves (``say`` hears its progress) or is refused.
    The answer starts with ``deployed`` only when the deployment serves."""
    base = f"http://127.0.0.1:{options.scheduler_port}"
    deployment_id = re.sub(r"[^A-Za-z0-9_-]", "-", model)  # a model's name may hold dots
    body = {"model": model, "deployment_id": deployment_id}
    all_in: list[float] = []  # when the scheduler first saw every worker

    def final() -> bool:
        if not all_in and workers and set(workers) <= scheduler_devices(options):
            all_in.append(time.monotonic())
        return bool(all_in) and time.monotonic() - all_in[0] >= settle_s

    placed, last = post_until_answered(
        f"{base}/placements", body, timeout_s, pause_s=1.0, final=final
    )
    if placed is None:
        later = f"; `tessera deploy {model}` once more devices join" if all_in else ""
        return f"could not deploy {model}: {last}{later}"
    said: list[int] = []  # the tenths of progress said so far

    def progress(status: dict[str, Any]) -> None:
        tenth = int(status.get("progress", 0.0) * 10)
        if status["phase"] == "loading" and (not said or tenth > said[-1]):
            said.append(tenth)
            say(f"loading {model}: {tenth * 10} %")

    status = follow_deployment(base, deployment_id, load_timeout_s, on_change=progress)
    if status is not None and status["phase"] == "serving":
        devices = [s["device_id"] for s in status.get("shards", ())]
        return f"deployed {model} on {', '.join(devices)}"
    return f"could not deploy {model}: {phase_text(deployment_id, status, load_timeout_s)}"


def restored_deployments(options: UpOptions) -> list[dict[str, Any]]:
    """The deployments the scheduler took up from its last checkpoint (a home's cluster
    started again): every one not stopped, as ``GET /placements`` gives them."""
    try:
        book = get_json(f"http://127.0.0.1:{options.scheduler_port}/placements")
    except (OSError, ValueError):
        return []
    return [d for d in book if d.get("phase") not in phases.FINAL]


def follow_restored(
    options: UpOptions, deployment: dict[str, Any], load_timeout_s: float = 300.0
) -> tuple[bool, str]:
    """Follow a restored deployment until it serves again; whether it does, and what to say."""
    name = deployment["deployment_id"]
    base = f"http://127.0.0.1:{options.scheduler_port}"
    status = follow_deployment(base, name, load_timeout_s)
    if status is not None and status["phase"] == "serving":
        devices = ", ".join(s["device_id"] for s in status.get("shards", ()))
        return True, f"restored {name} ({deployment['model']}), serving on {devices}"
    return False, f"restored {name}, not serving: {phase_text(name, status, load_timeout_s)}"


def first_answer(
    url: str, env: dict[str, str], model: str, timeout_s: float = 120.0
) -> tuple[bool, str]:
    """Send ``model`` a one-token chat request through the gateway until it answers; whether it
    did, and what to say."""
    keys = json.loads(env.get("TESSERA_GATEWAY_API_KEYS") or "[]")
    auth = keys and env.get("TESSERA_GATEWAY_AUTH") != "off"
    headers = {"authorization": f"Bearer {keys[0]}"} if auth else {}
    message = {"role": "user", "content": "Hi"}
    body = {"model": model, "messages": [message], "max_tokens": 1, "temperature": 0}
    started = time.monotonic()
    answer, last = post_until_answered(
        f"{url}/v1/chat/completions", body, timeout_s, pause_s=0.5, headers=headers
    )
    if answer is None:
        return False, f"{model} did not answer within {timeout_s:.0f} s: {last}"
    return True, f"{model} answered in {time.monotonic() - started:.1f} s"


def run_cluster(options: UpOptions, console: Console | None = None) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until a service dies (exit 1)."""
    try:
        cluster = Cluster(options, console)
    except StartRefused as exc:
        (console or Console(highlight=False, stderr=True)).print(f"tessera up: {exc}")
        return 2

    with stopped_by_signals():
        try:
            return serve(cluster, options)
        except KeyboardInterrupt:
            cluster.say("cluster", "stopping", "white")
            return 0
        finally:
            cluster.stop()


def serve(cluster: Cluster, options: UpOptions) -> int:
    """Start ``cluster``, restore and deploy its models, say ready, then watch it until a
    service it cannot lose dies (exit 1; Ctrl-C and SIGTERM raise ``KeyboardInterrupt``)."""
    cluster.start()
    if not cluster.wait_ready():
        dead = cluster.first_exited()
        why = f"{dead.name} {exit_text(dead.returncode)}" if dead else "timeout"
        cluster.say("cluster", f"failed to start: {why}", "bold red")
        return 1
    for device in say_left(cluster.access, cluster.urls("admin")["nats"], options.nats_ca):
        cluster.say("cluster", f"{device} was revoked while the cluster was down: it left", "white")
    url = f"http://{options.gateway_host}:{options.gateway_port}"
    has_workers = any(cluster.is_worker(c) for c in cluster.children)
    deployed, restored = [], []
    for deployment in restored_deployments(options):  # what the home's cluster served
        serves, said = follow_restored(options, deployment)
        cluster.say("cluster", said, "white" if serves else "bold red")
        if serves:
            deployed.append(deployment["model"])
            restored.append(deployment["deployment_id"])
    for model in options.deploy if has_workers else ():
        if model in deployed:
            continue
        said = deploy_model(
            options,
            model,
            [d for d, _ in cluster.worker_names()],
            say=lambda line: cluster.say("cluster", line, "white"),
        )
        cluster.say("cluster", said, "white" if said.startswith("deployed") else "bold red")
        if said.startswith("deployed"):
            deployed.append(model)
    env = cluster.child_env()
    silent = []
    for model in deployed:
        answered, said = first_answer(url, env, model)
        cluster.say("cluster", said, "white" if answered else "bold red")
        if not answered:
            silent.append(model)
    names = ", ".join(c.name for c in cluster.children) or "no services"
    if options.run_file is not None and options.run_file.name != "cluster.json":
        note = f"another cluster runs here; for this one: TESSERA_RUN_FILE={options.run_file}"
        cluster.say("cluster", note, "bold yellow")
    where = f"gateway {url} (OpenAI API {url}/v1, dashboard {url}/)"
    if silent:  # up, but not ready: the user sees why and the cluster stays to be looked at
        cluster.say("cluster", f"up, not serving {', '.join(silent)}: {where}", "bold red")
    else:
        back = f" (restored: {', '.join(restored)})" if restored else ""
        cluster.say("cluster", f"ready: {names}; {where}{back}", "bold green")
    if options.restart:
        supervise(cluster)  # until Ctrl-C or SIGTERM
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
