"""The README's five-minute tour, run as written against a real `tessera up`, so the front door
cannot go stale.

The commands are read from the README itself (its "A five-minute tour" section, one
``### `` step each), not copied here: a command added to the tour that this file does not know
how to run fails ``test_the_tour_shows_only_commands_this_test_runs``. Each is run as a user would
type it, with only what differs on a test machine replaced: the gateway's port (a free one, not
8000), the LAN address (127.0.0.1: both "machines" are this one), the join token the cluster
printed, and the model file (made at test time: a random-weight qwen2 GGUF under the README's
file name; nothing is downloaded). ``make up`` is run as what the Makefile's ``up`` recipe runs,
``tessera up $(ARGS)``, after checking that it still is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from libs.devices.host_device import host_device_id
from libs.runtime.procs import ServiceProcess
from libs.runtime.settings import LauncherSettings
from tests.e2e.cluster import RunningCluster
from tests.made_models import make_gguf

ROOT = Path(__file__).resolve().parents[2]
#: The `tessera` command of this virtualenv (`.venv/bin/tessera` in the README).
TESSERA = str(Path(sys.executable).parent / "tessera")
README_GATEWAY = "127.0.0.1:8000"
README_ADDRESS = "192.168.1.20"
STEPS = ("Start it", "Chat through any OpenAI client", "Open the dashboard")
OWN_MODEL, SECOND_MACHINE = "Add and deploy your own model", "Join a second machine"
RESTART = "Stop it and start it again"


def tour() -> dict[str, str]:
    """Each step of the README's tour: its ``### `` title → its text."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    steps = {}
    for part in section.split("\n### ")[1:]:
        title, _, body = part.partition("\n")
        steps[title.strip()] = body
    return steps


def blocks(body: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", body, flags=re.DOTALL)


def commands(body: str) -> list[str]:
    """The shell commands of a step, a continued line joined, comments dropped."""
    found = []
    for block in blocks(body, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def up_args(command: str) -> list[str]:
    """The options `make up ARGS="…"` hands `tessera up`, on this machine's address."""
    found = re.fullmatch(r'make up(?: ARGS="(.*)")?', command)
    assert found, command
    return shlex.split((found.group(1) or "").replace(README_ADDRESS, "127.0.0.1"))


#: The commands this file knows how to run (``run``, ``up_args``, the join in the last test).
KNOWN = re.compile(
    r"make (up|join)( .*)?|curl .*|\.venv/bin/tessera (chat|devices|models|deploy|placements)( .*)?"
)


def test_the_tour_shows_only_commands_this_test_runs() -> None:
    steps = tour()
    assert list(steps) == [*STEPS, OWN_MODEL, RESTART, SECOND_MACHINE]
    every = [command for body in steps.values() for command in commands(body)]
    assert [c for c in every if not KNOWN.fullmatch(c)] == []
    recipe = (ROOT / "Makefile").read_text().split("\nup:", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/tessera up $(ARGS)" in recipe  # what `make up` runs, and so what is run here


def start(args: list[str]) -> RunningCluster:
    """`tessera up` with the README's options, ready (its devices as the default)."""
    devices = int(LauncherSettings.model_fields["devices"].default)
    cluster = RunningCluster(*args, devices=devices)
    try:
        cluster.wait_for("ready:", 300)
    except AssertionError:
        cluster.stop()
        raise
    return cluster


def on_this_machine(text: str, cluster: RunningCluster, tmp: Path) -> str:
    return (
        text.replace(README_GATEWAY, f"127.0.0.1:{cluster.port}")
        .replace("~/models/", f"{tmp}/")
        .replace(".venv/bin/tessera", TESSERA)
    )


def run(command: str, cluster: RunningCluster, tmp: Path) -> str:
    """One command of the tour, as typed, against ``cluster``; its output (exit status 0)."""
    argv = shlex.split(on_this_machine(command, cluster, tmp))
    if argv[0] == TESSERA:
        argv = [sys.executable, *argv]
    done = subprocess.run(
        argv,
        env={**os.environ, "TESSERA_RUN_FILE": str(cluster.run_file), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


class Machine:
    """The cluster of steps 1–5 (the restart step swaps in the one started again) and the
    own model's greedy answer once it is deployed, so the steps run in any order."""

    def __init__(self, cluster: RunningCluster) -> None:
        self.cluster = cluster
        #: (name, greedy answer) of the own model once deployed; random weights may end at
        #: once (an empty text), so the answer keeps how it ended and its token count too.
        self.own: tuple[str, tuple[str, str, int]] | None = None

    def deploy_own_model(self, tmp: Path) -> tuple[str, tuple[str, str, int]]:
        """Step 4 as typed, once: the own model added and deployed, served by name."""
        if self.own is not None:
            return self.own
        cluster = self.cluster
        add, deploy, placements = commands(tour()[OWN_MODEL])
        file_name = re.search(r"~/models/(\S+\.gguf)", add)
        assert file_name, add
        make_gguf(tmp / file_name.group(1), "qwen2", "Q8_0")
        run(add, cluster, tmp)
        run(deploy, cluster, tmp)
        name = deploy.split()[-1]
        assert name in run(placements, cluster, tmp)
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="-")
        assert name in [model.id for model in client.models.list()]
        reply = client.completions.create(model=name, prompt="Hello", max_tokens=4)
        assert reply.model == name and reply.choices[0].finish_reason in ("stop", "length")
        self.own = name, greedy(client, name)
        return self.own


@pytest.fixture(scope="class")
def one_machine() -> Iterator[Machine]:
    (start_up,) = commands(tour()["Start it"])
    machine = Machine(start(up_args(start_up)))
    yield machine
    machine.cluster.stop()


class TestOnOneMachine:
    """Steps 1–5 on the cluster `make up` starts, then on the same home started again; in
    any order (a step that needs the own model deploys it if step 4 has not yet)."""

    def test_start_chat_and_open_the_dashboard(self, one_machine: Machine, tmp_path: Path) -> None:
        cluster = one_machine.cluster
        steps = tour()
        ready = [line for line in cluster.lines if "ready:" in line]
        assert ready and f"gateway http://127.0.0.1:{cluster.port}" in ready[0], ready
        (script,) = blocks(steps["Chat through any OpenAI client"], "python")
        done = subprocess.run(
            [sys.executable, "-c", on_this_machine(script, cluster, tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        curl, chat = commands(steps["Chat through any OpenAI client"])
        answer = json.loads(run(curl, cluster, tmp_path))
        assert answer["choices"][0]["message"]["content"].strip()
        assert run(chat, cluster, tmp_path).strip()

        body = steps["Open the dashboard"]
        urls = re.findall(r"http://127\.0\.0\.1:8000/\S*", body.split("```")[0])
        assert urls, "the dashboard's step names no address to open"
        for url in urls:
            page = httpx.get(on_this_machine(url, cluster, tmp_path), timeout=10)
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        (devices,) = commands(body)
        assert "worker-0" in run(devices, cluster, tmp_path)

    def test_tessera_preview_works_for_every_model_the_docs_name(
        self, one_machine: Machine, tmp_path: Path
    ) -> None:
        """Each `tessera preview` of the README and the docs, run as typed on this cluster: a
        file is made at test time under the name the docs give it (nothing is downloaded); a
        name the cluster does not know yet is added first from the file the docs add it from."""
        cluster = one_machine.cluster
        pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        every = [c for page in pages for c in commands(page.read_text())]
        adds = [c for c in every if c.startswith(".venv/bin/tessera models add ~/models/")]
        previews = [c for c in every if c.startswith(".venv/bin/tessera preview ")]
        assert len(previews) >= 3, previews  # names and files, in cli.md and models.md
        added = []
        for command in previews:
            model = shlex.split(command)[2]
            if model.startswith("~/models/"):
                make_gguf(tmp_path / model.removeprefix("~/models/"), "qwen2", "Q8_0")
            elif model not in registered(cluster):
                files = [a.split()[3] for a in adds if Path(a.split()[3]).stem.lower() == model]
                assert files, f"the docs preview {model} but add it from no file"
                make_gguf(tmp_path / files[0].removeprefix("~/models/"), "qwen2", "Q8_0")
                run(f".venv/bin/tessera models add {files[0]}", cluster, tmp_path)
                added.append(model)
            said = run(command, cluster, tmp_path)
            assert "worker-0" in said or "GB" in said, f"{command}\n{said}"
        for model in added:  # the tour's own steps add the models they name themselves
            run(f".venv/bin/tessera models rm {model}", cluster, tmp_path)

    def test_add_and_deploy_your_own_model(self, one_machine: Machine, tmp_path: Path) -> None:
        name, _ = one_machine.deploy_own_model(tmp_path)
        client = openai.OpenAI(base_url=f"{one_machine.cluster.base_url}/v1", api_key="-")
        assert greedy(client, name)[2] > 0  # served by name (on the cluster started again too)

    def test_stop_it_and_start_it_again(self, one_machine: Machine, tmp_path: Path) -> None:
        """SIGTERM, then `make up` on the same home: the own model is listed, answers the same
        greedy text once `ready` is printed (its deployment named there), and the token is
        the same."""
        start_again, listed = commands(tour()[RESTART])
        name, said_before = one_machine.deploy_own_model(tmp_path)
        before = one_machine.cluster
        token = json.loads((before.home / "access.json").read_text())["passwords"]["join"]
        before.stop()
        again = RunningCluster(
            *up_args(start_again),
            devices=int(LauncherSettings.model_fields["devices"].default),
            home=before.home,
            port=before.port,
        )
        one_machine.cluster = again  # stopped by the fixture; later steps run on it
        ready = again.wait_for("ready:", 300)
        restored = re.search(r"\(restored: (.*)\)", ready)
        assert restored, ready
        placed = httpx.get(f"{again.base_url}/v1/cluster/placements", timeout=10).json()
        own = [p["deployment_id"] for p in placed if p["model"] == name]
        assert own and own[0] in restored.group(1), (own, ready)
        assert name in run(listed, again, tmp_path)
        client = openai.OpenAI(base_url=f"{again.base_url}/v1", api_key="-")
        assert greedy(client, name) == said_before
        kept = json.loads((again.home / "access.json").read_text())["passwords"]["join"]
        assert kept == token


def registered(cluster: RunningCluster) -> set[str]:
    cards = httpx.get(f"{cluster.base_url}/v1/cluster/models", timeout=10).json()
    return {card["name"] for card in cards}


def greedy(client: openai.OpenAI, model: str) -> tuple[str, str, int]:
    """The greedy text of ``model``, how it ended and how many tokens it took."""
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    used = reply.usage.completion_tokens if reply.usage else -1
    return reply.choices[0].text or "", reply.choices[0].finish_reason, used


def test_join_a_second_machine(tmp_path: Path) -> None:
    """The cluster started again with --listen; the printed `make join` (from a fresh clone:
    it builds what `make up` does) joins from another "machine" (this one: a second device of
    the cluster); both ends run llama.cpp by default; `tessera devices` lists it."""
    listen, devices = (c for c in commands(tour()[SECOND_MACHINE]) if "make join" not in c)
    (join,) = (c for c in commands(tour()[SECOND_MACHINE]) if "make join" in c)
    cluster = start(up_args(listen))
    joined: ServiceProcess | None = None
    try:
        assert any("engines: CPU workers run llama.cpp" in line for line in cluster.lines)
        said = next(line for line in cluster.lines if "from a fresh clone there:" in line)
        printed = re.search(r"make join ADDR=(\S+) TOKEN=(\S+)", said)
        assert printed, said
        url, token = printed.groups()
        typed = re.sub(r"ADDR=\S+", f"ADDR={url}", join)
        typed = re.sub(r"TOKEN=\S+", f"TOKEN={token}", typed)
        # `make` run as typed, from the repository, not as part of an outer make's jobs; its
        # output is `tessera join`'s. Python execs it: ServiceProcess runs a Python.
        outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")
        argv = ["env", *(f"-u{name}" for name in outer), "make", "-C", str(ROOT)]
        argv += shlex.split(typed)[1:]
        joined = ServiceProcess(
            "join",
            {"COLUMNS": "200"},
            ["-c", "import os, sys; os.execvp(sys.argv[1], sys.argv[1:])", *argv],
            ready_line=lambda line: "ready: this host serves" in str(line.get("msg", "")),
        ).start(ready_timeout_s=300)
        said = [str(line.get("msg", "")) for line in joined.lines]
        assert any(f"joined {url}" in m and "engine llamacpp" in m for m in said), said[-20:]
        device = host_device_id()
        assert device in run(devices, cluster, tmp_path)
        rows = json.loads(run(f"{devices} --json", cluster, tmp_path))
        assert any(row["device_id"] == device and row["state"] == "alive" for row in rows), rows
    finally:
        if joined is not None and joined.process is not None:
            os.killpg(joined.process.pid, signal.SIGINT)  # Ctrl-C: make and tessera join
            with contextlib.suppress(subprocess.TimeoutExpired):
                joined.process.wait(timeout=45)  # it leaves once its shards moved
            joined.stop(timeout_s=5)
        cluster.stop()
