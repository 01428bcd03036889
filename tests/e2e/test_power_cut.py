"""A power cut: SIGKILL of every process of `tessera up`, and of the command the user was
running, at once; then `tessera up` on the same home, as a boot would. Cut during `tessera
models add`, the registry holds the model whole (listed, its file in the cluster's store
hashing to its card) or not at all (not listed, and added again as if never tried); cut during
`tessera deploy`, the model is still registered and its deployment serves again, restored or
deployed once more. Nothing is half-registered either way."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from libs.cluster import runfile
from libs.contracts.models import ModelCard
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.proc_tree import descendants
from libs.weights.whole_files import fetch
from tests.e2e.cluster import RunningCluster
from tests.made_models import make_gguf

pytestmark = pytest.mark.timeout(900)
#: Big enough that its checksum and its sending to the store take a while here.
FILE_BYTES = 96_000_000
SPLIT = "cut-split"


def tessera(cluster: RunningCluster, *args: str) -> subprocess.Popen[str]:
    """A `tessera` command against ``cluster``, started (not waited for)."""
    return subprocess.Popen(
        [sys.executable, "-m", "libs.cli.main", *args],
        env={**os.environ, "TESSERA_RUN_FILE": str(cluster.run_file), "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def done(command: subprocess.Popen[str]) -> str:
    out, _ = command.communicate(timeout=300)
    assert command.returncode == 0, out
    return out


def power_cut(cluster: RunningCluster, command: subprocess.Popen[str]) -> None:
    """SIGKILL every process of ``cluster`` and ``command`` at once."""
    root = cluster.process.pid
    for pid in (root, *descendants(root), command.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    cluster.process.wait(30)
    command.wait(30)


def boot(home: Path, port: int | None) -> RunningCluster:
    """`tessera up` on ``home``, ready: SmolLM2 on one worker, two free for the split."""
    cluster = RunningCluster("--workers", "3", home=home, port=port)
    cluster.wait_for("ready:", 300)
    return cluster


def scheduler(cluster: RunningCluster) -> str:
    return str(runfile.read(cluster.run_file)["scheduler_url"])


def registered(cluster: RunningCluster) -> dict[str, dict[str, Any]]:
    cards = httpx.get(f"{scheduler(cluster)}/models", timeout=30).json()
    return {c["name"]: c for c in cards}


def store_copy_is_whole(cluster: RunningCluster, card: dict[str, Any], tmp: Path) -> None:
    """Fetch the model's file from the cluster's store, as a host without it would: the fetch
    checks its size and sha256 against the card (``WeightsError`` otherwise)."""
    running = runfile.read(cluster.run_file)
    model = ModelCard.model_validate(
        {k: v for k, v in card.items() if k not in ("deployments", "engines")}
    )  # the card, less what the API adds to it

    async def fetched() -> None:
        ca = running.get("nats_ca")
        nc = await connect_nats(running["nats_url"], "test", ca_file=Path(ca) if ca else None)
        try:
            await fetch(nc.jetstream(), model, tmp / "fetched.gguf")
        finally:
            await close_nats(nc)

    asyncio.run(fetched())


def greedy(cluster: RunningCluster, model: str) -> str:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="-", max_retries=4)
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0)
    return reply.choices[0].text or ""


def test_a_power_cut_during_models_add_then_during_deploy(tmp_path: Path) -> None:
    home = tmp_path / "home"
    whole = make_gguf(tmp_path / "whole.gguf", "qwen2", target_bytes=FILE_BYTES, seed=1)
    cut = make_gguf(tmp_path / "cut.gguf", "qwen2", target_bytes=FILE_BYTES, seed=2)
    cluster = boot(home, None)
    port = cluster.port
    try:
        began = time.monotonic()  # how long an add takes here, uncut
        done(tessera(cluster, "models", "add", str(whole), "--name", "whole-model"))
        took = time.monotonic() - began
        adding = tessera(cluster, "models", "add", str(cut), "--name", "cut-model")
        time.sleep(took * 0.7)  # past the checksum, into the sending (or just after it)
        power_cut(cluster, adding)
        cluster = boot(home, port)
        cards = registered(cluster)
        assert "whole-model" in cards  # added before the cut: kept
        store_copy_is_whole(cluster, cards["whole-model"], tmp_path)
        if "cut-model" in cards:  # registered before the cut: its file whole in the store
            store_copy_is_whole(cluster, cards["cut-model"], tmp_path)
            print("the cut came after cut-model was registered")
        else:  # not registered: added again as if never tried
            print("the cut came before cut-model was registered")
            done(tessera(cluster, "models", "add", str(cut), "--name", "cut-model"))
        store_copy_is_whole(cluster, registered(cluster)["cut-model"], tmp_path)

        deploying = tessera(cluster, "deploy", "cut-model", "--shards", "2", "--id", SPLIT)
        deadline = time.monotonic() + 120
        while placement_phase(cluster, SPLIT) not in ("loading", "serving"):
            if deploying.poll() is not None or time.monotonic() > deadline:
                out = deploying.communicate(timeout=30)[0] if deploying.poll() is not None else ""
                raise AssertionError(f"the deployment never began loading: {out}")
            time.sleep(0.1)
        power_cut(cluster, deploying)
        cluster = boot(home, port)
        cards = registered(cluster)
        assert {"whole-model", "cut-model"} <= set(cards)
        store_copy_is_whole(cluster, cards["cut-model"], tmp_path)
        phase = placement_phase(cluster, SPLIT)
        print(f"the deployment cut while loading is {phase} after the boot")
        if phase != "serving":  # not restored: deployed again as if never tried
            httpx.delete(f"{scheduler(cluster)}/placements/{SPLIT}", timeout=30)
            done(tessera(cluster, "deploy", "cut-model", "--shards", "2", "--id", SPLIT))
        assert greedy(cluster, "cut-model")  # it answers
    finally:
        cluster.stop()


def placement_phase(cluster: RunningCluster, deployment_id: str) -> str | None:
    try:
        reply = httpx.get(f"{scheduler(cluster)}/placements/{deployment_id}", timeout=10)
    except httpx.HTTPError:
        return None
    return reply.json().get("phase") if reply.status_code == 200 else None
