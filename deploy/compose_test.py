"""``make compose-test``: docker-compose.yml run for real and checked as a user would.

Installs Docker from Debian when missing, starts ``dockerd`` if none runs, makes the base images
Docker Hub cannot give here (``deploy/images/build.sh``) and the project's image, brings the
stack up with fresh credentials, checks it, and takes everything down again (containers,
networks, volumes) whatever happened. Each check prints its name and its time; a failure prints
the last log lines of the service it concerns. Built images stay: a second run reuses them.

``--nats-servers 3`` runs the profile ``nats-cluster`` (NATS as a cluster of three) and kills
one of the NATS servers mid-stream as well.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

ROOT = Path(__file__).resolve().parents[1]
ACCESS = ROOT / "deploy" / "access"
WHEELS = ROOT / "deploy" / "images" / "wheels"
LLAMA, PREBUILT = ROOT / ".llama", ROOT / "deploy" / "images" / "llama"
LLAMA_FILES = (
    "llama-server", "ggml-rpc-server", "llama-quantize", "architectures.txt", "tensor_types.txt"
)  # fmt: skip
PROJECT = "tessera-compose-test"
MODEL = "smollm2-135m-instruct"
GATEWAY = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name three colours of the rainbow."}
]
#: Left out here, with why.
LEFT_OUT = {
    "otel-collector": "profile tracing: its image comes only from Docker Hub",
    "jaeger": "profile tracing: its image comes only from Docker Hub",
    "vllm-worker": "profile gpu: needs an NVIDIA GPU",
}

T = TypeVar("T")


class CheckFailed(Exception):
    def __init__(self, message: str, service: str = "") -> None:
        super().__init__(message)
        self.service = service


class Broken(CheckFailed):
    """A failure no waiting mends (a service unhealthy or exited): ``until`` stops at once."""


def run(
    *args: str, check: bool = True, quiet: bool = False, env: dict[str, str] | None = None
) -> str:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        raise CheckFailed(
            f"{' '.join(args[:3])} … failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    if not quiet and done.stdout.strip():
        print("\n".join(f"   {line.strip()}" for line in done.stdout.splitlines()), flush=True)
    return done.stdout


@contextmanager
def step(name: str) -> Iterator[None]:
    started = time.monotonic()
    print(f"-- {name}", flush=True)
    yield
    print(f"ok {name} ({time.monotonic() - started:.1f} s)", flush=True)


def until(what: str, probe: Callable[[], T | None], timeout_s: float, service: str = "") -> T:
    """``probe()``'s first answer that is not None (exceptions count as not yet), polled every
    second; ``service`` is the one whose logs to show when it never comes."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            if (answer := probe()) is not None:
                return answer
        except Broken:
            raise
        except Exception as exc:  # the service is not there yet
            last = exc
        time.sleep(1.0)
    raise CheckFailed(f"{what} not within {timeout_s:.0f} s (last: {last})", service)


# -- the engine and the images ---------------------------------------------------------------
def docker_client() -> str:
    """A client that builds with BuildKit: one with buildx, else Debian's 20.10 (built in)."""
    buildx = subprocess.run(["docker", "buildx", "version"], capture_output=True)
    return (
        "docker"
        if buildx.returncode == 0 or not Path("/usr/bin/docker").exists()
        else "/usr/bin/docker"
    )


#: The Debian package of each command the run needs.
PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
}


def engine() -> None:
    packages = [package for command, package in PACKAGES.items() if shutil.which(command) is None]
    if packages:
        print(f"   installing from Debian: {', '.join(packages)}", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["update"], ["install", "-y", *packages]):
            run("apt-get", "-qq", *command, quiet=True, env=env)
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        log = (ROOT / "test-artifacts").resolve()
        log.mkdir(exist_ok=True)
        print(f"   starting dockerd (log: {log}/dockerd.log)", flush=True)
        with open(log / "dockerd.log", "ab") as out:
            subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
        until(
            "dockerd",
            lambda: subprocess.run(["docker", "info"], capture_output=True).returncode == 0 or None,
            60,
        )


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


@functools.cache
def pip_settings() -> dict[str, str]:
    pip = ROOT / ".venv" / "bin" / "pip"
    listed = subprocess.run([str(pip), "config", "list"], capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in listed.splitlines() if "=" in line)


def pip_setting(name: str) -> str:
    """pip's setting ``name`` as pip sees it here (its environment first, then its files)."""
    values = pip_settings()
    for scope in (":env:", "global", "install"):
        if value := values.get(f"{scope}.{name}", "").strip("'\""):
            return value
    return ""


def host_llama() -> None:
    """The host's CPU build of llama.cpp (``make llama``, the script the image runs) into
    ``deploy/images/llama``, which the image then takes instead of compiling its own."""
    build = (LLAMA / ".installed").read_text().split() if (LLAMA / ".installed").exists() else []
    if len(build) < 3 or build[2] != "cpu":
        print("   llama.cpp: no CPU build here (make llama): the image builds it", flush=True)
        return
    for name in (".installed", *LLAMA_FILES):
        shutil.copyfile(LLAMA / name, PREBUILT / name)  # the file, not its link
        shutil.copymode(LLAMA / name, PREBUILT / name)
    print(f"   llama.cpp {build[0]} from {LLAMA}", flush=True)


def project_image(docker: str) -> None:
    """tessera:latest; where pip is configured with a local wheel folder holding CPU torch (the
    PyTorch index is not reachable), that wheel is preferred; pip's CA bundle is a build secret;
    the host's llama.cpp build is taken where there is one (``host_llama``)."""
    host_llama()
    args = [docker, "build", "--target", "cpu", "-t", "tessera:latest"]
    for folder in pip_setting("find-links").split():
        for wheel in Path(folder).glob("torch-*+cpu-*.whl"):
            if not (WHEELS / wheel.name).exists():
                shutil.copy2(wheel, WHEELS / wheel.name)
            args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
            print(f"   torch from {wheel}", flush=True)
    if cert := pip_setting("cert"):
        args += ["--secret", f"id=pip_cert,src={cert}"]
    done = subprocess.run(
        [*args, "."],
        cwd=ROOT,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise CheckFailed(f"the image did not build:\n{done.stderr[-3000:]}")
    size = run(docker, "image", "inspect", "-f", "{{.Size}}", "tessera:latest", quiet=True)
    print(f"   tessera:latest: {int(size) / 1e9:.2f} GB", flush=True)


# -- the stack -----------------------------------------------------------------------------
class Stack:
    def __init__(self, profiles: tuple[str, ...] = ()) -> None:
        self.compose = [*compose_command(), "-p", PROJECT, "--env-file", str(ACCESS / "access.env")]
        self.compose += [arg for p in profiles for arg in ("--profile", p)]
        env = dict(line.split("=", 1) for line in (ACCESS / "access.env").read_text().splitlines())
        self.key = env["TESSERA_API_KEY"]
        self.http = httpx.Client(
            base_url=GATEWAY, headers={"Authorization": f"Bearer {self.key}"}, timeout=10
        )

    def __call__(self, *args: str, check: bool = True) -> str:
        return run(*self.compose, *args, check=check, quiet=True)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).strip()

    def states(self) -> dict[str, str]:
        """Each service's state (its containers, exited ones too, in one inspect): its health
        where it has a healthcheck."""
        ids = self("ps", "-a", "-q").split()
        states = {}
        for info in json.loads(run("docker", "inspect", *ids, quiet=True)) if ids else []:
            service = info["Config"]["Labels"]["com.docker.compose.service"]
            state = info["State"]
            if service not in LEFT_OUT:
                health = state.get("Health", {}).get("Status")
                states[service] = health or f"{state['Status']} (exit {state['ExitCode']})"
        return states

    def logs(self, service: str, lines: int = 40) -> str:
        return self("logs", "--no-color", "--tail", str(lines), service, check=False)

    def down(self) -> None:
        self("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)


#: The services that run once and exit 0 (compose starts them again on failure).
ONE_SHOTS = ("models", "deploy")


def all_healthy(stack: Stack) -> dict[str, str] | None:
    states = stack.states()
    waiting = {s: v for s, v in states.items() if v != "healthy" and v != "exited (exit 0)"}
    for service, state in waiting.items():
        if state == "unhealthy" or (state.startswith("exited") and service not in ONE_SHOTS):
            raise Broken(f"{service} is {state}", service)
    return None if waiting or "deploy" not in states else states


def placement(stack: Stack, avoiding: str = "") -> list[str] | None:
    """The devices of the model's shards; None while not placed (or still on ``avoiding``)."""
    for deployment in stack.http.get("/v1/cluster/placements").raise_for_status().json():
        devices = [a["device_id"] for a in deployment["assignments"]]
        if deployment["deployment_id"] == MODEL and devices and avoiding not in devices:
            return devices
    return None


def stream(
    client: OpenAI, on_piece: Callable[[int], None] = lambda n: None
) -> tuple[str, list[float]]:
    """The greedy answer streamed, and when each piece arrived (monotonic)."""
    pieces: list[str] = []
    times: list[float] = []
    chunks = client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=48, temperature=0, stream=True
    )
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            times.append(time.monotonic())
            on_piece(len(pieces))
    return "".join(pieces), times


def check_stack(stack: Stack, docker: str, up_at: float) -> None:
    client = OpenAI(base_url=f"{GATEWAY}/v1", api_key=stack.key, max_retries=0, timeout=120)
    with step("every service healthy (models and deploy ran once and exited 0)"):
        states = until("every service healthy", lambda: all_healthy(stack), 600)
        print(f"   {json.dumps(states)}", flush=True)
    with step(f"{MODEL} deployed on the worker containers"):
        devices = until("a placement", lambda: placement(stack), 60, "deploy")
        print(f"   shards on {devices}", flush=True)
    with step("first token through the gateway"):
        first = until("a first token", lambda: stream(client)[1][0], 120, "gateway")
        print(f"   {first - up_at:.1f} s from `up` to the first token", flush=True)
    with step("openai client: models, chat, streaming"):
        models = [m.id for m in client.models.list()]
        if MODEL not in models:
            raise CheckFailed(f"{MODEL} not in /v1/models: {models}", "gateway")
        chat = client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=48, temperature=0
        )
        reference = chat.choices[0].message.content or ""
        streamed, _ = stream(client)
        if streamed != reference:
            raise CheckFailed(f"streamed {streamed!r} but chat answered {reference!r}", "gateway")
        tokens = chat.usage.completion_tokens if chat.usage else "?"
        print(f"   answer: {reference[:60]!r}… ({tokens} tokens)", flush=True)
        wrong = httpx.get(f"{GATEWAY}/v1/models", headers={"Authorization": "Bearer wrong"})
        if wrong.status_code != 401:
            raise CheckFailed(f"a wrong API key got {wrong.status_code}", "gateway")
    check_split(stack, client, reference)
    check_batches(stack, client)
    with step("Prometheus: every target up, alert rules loaded"):

        def targets_up() -> list[str] | None:
            active = httpx.get(f"{PROMETHEUS}/api/v1/targets").json()["data"]["activeTargets"]
            up = [t["labels"]["instance"] for t in active if t["health"] == "up"]
            down = {t["labels"]["instance"]: t["lastError"] for t in active if t["health"] != "up"}
            if down:
                raise CheckFailed(f"down: {down}")
            return up or None

        up = until("every scrape target up", targets_up, 60, "prometheus")
        groups = httpx.get(f"{PROMETHEUS}/api/v1/rules").json()["data"]["groups"]
        rules = sum(len(g["rules"]) for g in groups)
        if not rules:
            raise CheckFailed("no alert rules loaded", "prometheus")
        print(
            f"   {len(up)} targets up: {sorted(up)}; {rules} rules in {len(groups)} groups",
            flush=True,
        )
    with step("docker kill of the serving worker mid-stream: the stream completes on another"):
        victim = devices[0]
        killed: dict[str, float] = {}

        def kill(n: int) -> None:
            if n == 4 and not killed:
                run(docker, "kill", stack.container(victim), quiet=True)
                killed["at"] = time.monotonic()

        text, times = stream(client, kill)
        if "at" not in killed:
            raise CheckFailed("the stream ended before the kill", victim)
        if text != reference:
            raise CheckFailed(f"after the kill: {text!r}, alone: {reference!r}", victim)
        gap = max(b - a for a, b in itertools.pairwise(times))
        moved = until(
            "the placement off the killed worker",
            lambda: placement(stack, avoiding=victim),
            30,
        )
        print(
            f"   killed {victim}; the answer is whole and identical; longest wait between tokens "
            f"{gap:.2f} s; shards now on {moved}",
            flush=True,
        )
    if "nats-2" in stack.states():
        kill_a_nats_server(stack, docker, client, reference)
    restart_redis_and_scheduler(stack, client, reference)


def check_split(stack: Stack, client: OpenAI, reference: str) -> None:
    """A second copy of the model split over both worker containers: llama.cpp's RPC from one
    container's server to the other's, through mutual TLS with the certificates `tessera
    access` wrote; asked by its id, it answers as the whole model does."""
    with step("a copy split over both worker containers (llama.cpp's RPC between them, TLS)"):
        asked = {"model": MODEL, "deployment_id": "split", "shards": 2}
        placed = stack.http.post("/v1/cluster/placements", json=asked, timeout=60)
        if placed.status_code != 201:
            raise CheckFailed(f"the split was not placed: {placed.text}", "scheduler")

        def serving() -> list[str] | None:
            state = stack.http.get("/v1/cluster/placements/split").raise_for_status().json()
            if state["phase"] in ("refused", "failed"):
                raise CheckFailed(f"the split {state['phase']}: {state['reason']}", "worker-0")
            shards = [s["device_id"] for s in state["shards"]]
            return shards if state["phase"] == "serving" else None

        devices = until("the split serving", serving, 180, "worker-0")
        chat = client.chat.completions.create(
            model="split", messages=PROMPT, max_tokens=48, temperature=0
        )
        answer = chat.choices[0].message.content or ""
        stack.http.delete("/v1/cluster/placements/split", timeout=60).raise_for_status()
        if sorted(devices) != ["worker-0", "worker-1"]:
            raise CheckFailed(f"the split runs on {devices}, not on both workers", "scheduler")
        if answer != reference:
            raise CheckFailed(f"split: {answer!r}, whole: {reference!r}", "worker-0")
        print(f"   shards on {devices}; the same answer as the whole model", flush=True)


def check_batches(stack: Stack, client: OpenAI) -> None:
    """A batch of chat requests and a training job, each run by the batch-worker container
    (Celery), every custom id answered once."""
    with step("a batch and a training job, run by the batch worker (Celery)"):
        ended = {}
        for endpoint, body in (
            ("/v1/chat/completions", {"model": MODEL, "messages": PROMPT, "max_tokens": 8}),
            ("/v1/tessera/train", {"model": "tessera-mlp", "steps": 300, "every": 50}),
        ):
            lines = [{"custom_id": f"c-{i}", "url": endpoint, "body": body} for i in range(3)]
            content = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file = client.files.create(file=("batch.jsonl", content), purpose="batch")
            made = stack.http.post(
                "/v1/batches",
                json={"input_file_id": file.id, "endpoint": endpoint, "completion_window": "10m"},
                timeout=300,  # admission measures the rate first
            )
            if made.status_code != 200:
                raise CheckFailed(f"{endpoint}: {made.status_code} {made.text}", "gateway")
            batch_id = made.json()["id"]

            def done(batch_id: str = batch_id) -> str | None:
                batch = client.batches.retrieve(batch_id)
                return batch.output_file_id if batch.status == "completed" else None

            output = until(f"the {endpoint} batch completed", done, 300, "batch-worker")
            rows = [json.loads(x) for x in client.files.content(output).text.splitlines()]
            if sorted(r["custom_id"] for r in rows) != ["c-0", "c-1", "c-2"]:
                raise CheckFailed(f"{endpoint}: output {rows}", "batch-worker")
            ended[endpoint] = rows[0]["response"]["body"].get("usage")
        print(f"   each answered once; usage {ended}", flush=True)


def registered(stack: Stack) -> list[str]:
    cards = stack.http.get("/v1/cluster/models").raise_for_status().json()
    return [c["name"] for c in cards]


def restart_redis_and_scheduler(stack: Stack, client: OpenAI, reference: str) -> None:
    """Redis keeps its data in a volume (an append-only file): restarted, then the scheduler
    after it, the model is still registered and its deployment serves the same answer."""
    with step("docker compose restart redis, then scheduler: the registry and deployment kept"):
        before = registered(stack)
        stack("restart", "--timeout", "10", "redis")
        stack("restart", "--timeout", "10", "scheduler")
        after = until("the registry read again", lambda: registered(stack) or None, 120, "redis")
        if MODEL not in after or set(after) != set(before):
            raise CheckFailed(f"registered before: {before}; after: {after}", "redis")
        until("a placement", lambda: placement(stack), 120, "scheduler")

        def answered() -> str:  # until's: an error counts as not yet
            chat = client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=48, temperature=0
            )
            return chat.choices[0].message.content or ""

        answer = until("an answer", answered, 180, "scheduler")
        if answer != reference:
            raise CheckFailed(f"after the restarts: {answer!r}, before: {reference!r}", "worker")
        print(f"   registered: {after}; the same answer", flush=True)


def kill_a_nats_server(stack: Stack, docker: str, client: OpenAI, reference: str) -> None:
    with step("docker kill of one of the three NATS servers mid-stream: the answer completes"):
        killed: dict[str, float] = {}

        def kill(n: int) -> None:
            if n == 4 and not killed:
                run(docker, "kill", stack.container("nats"), quiet=True)
                killed["at"] = time.monotonic()

        text, times = stream(client, kill)
        if "at" not in killed:
            raise CheckFailed("the stream ended before the kill", "nats")
        if text != reference:
            raise CheckFailed(f"after the kill: {text!r}, alone: {reference!r}", "gateway")
        again, _ = stream(client)  # and the next request, with two servers left
        if again != reference:
            raise CheckFailed(f"after the kill, a new request: {again!r}", "gateway")
        gap = max(b - a for a, b in itertools.pairwise(times))
        print(
            f"   killed nats; the answer is whole and identical, and so is the next one; longest "
            f"wait between tokens {gap:.2f} s",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description="docker compose run and checked for real")
    parser.add_argument("--nats-servers", type=int, choices=(1, 3), default=1)
    args = parser.parse_args()
    busy = [p for p in (8000, 9090, 9093) if socket.socket().connect_ex(("127.0.0.1", p)) == 0]
    if busy:
        print(f"ports {busy} are taken here: stop what holds them (`make up`?)", file=sys.stderr)
        return 1
    stack: Stack | None = None
    try:
        with step("Docker engine"):
            engine()
        with step("base images (made from Debian where Docker Hub cannot be reached)"):
            run(str(ROOT / "deploy" / "images" / "build.sh"))
        docker = docker_client()  # once Docker is installed
        with step("project image tessera:latest"):
            project_image(docker)
        tessera = str(ROOT / ".venv" / "bin" / "tessera")
        run(tessera, "access", "--out", str(ACCESS), "--nats-servers", str(args.nats_servers))
        stack = Stack(("nats-cluster",) if args.nats_servers == 3 else ())
        stack.down()  # what an interrupted run left
        up_at = time.monotonic()
        with step("docker compose up"):
            try:
                stack("up", "-d")
            except CheckFailed as failed:  # compose names a container: say which service
                states = stack.states()
                bad = sorted(
                    (s for s, v in states.items() if v not in ("healthy", "exited (exit 0)")),
                    key=lambda s: "unhealthy" not in states[s] and "exit" not in states[s],
                )
                raise CheckFailed(str(failed), bad[0] if bad else "") from None
            for service, why in LEFT_OUT.items():
                print(f"   left out: {service} ({why})", flush=True)
        check_stack(stack, docker, up_at)
    except CheckFailed as failed:
        print(f"FAILED: {failed}", flush=True)
        if stack is not None and failed.service:
            print(f"-- last lines of {failed.service}:\n{stack.logs(failed.service)}", flush=True)
        return 1
    finally:
        if stack is not None:
            with step("docker compose down (containers, networks, volumes)"):
                stack.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
