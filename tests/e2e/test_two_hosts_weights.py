"""Weights carried by the cluster, on two hosts (network namespaces, as ``test_two_hosts.py``),
each with its default engine (llama.cpp, built here): a model added on host A only is split
across A and B, then served whole on B, each time with llama.cpp's own server's greedy text on
the same file; host B never
had the file (its processes run in a mount namespace where the file's folder is an empty
tmpfs) and receives its layers from the head's llama-server through RPC (over the cluster's
mutual-TLS channel), which B's RPC server keeps in its file cache; a second placement of the
model on B sends the cached tensors as hashes, not again. Placed with B at its head (which
reads the file itself), B's worker receives the file lent by A's worker, which holds it
(``libs/weights/lending.py``; the cluster's object store, where ``tessera models add`` put it
on A, is the fallback).

llama.cpp sends a tensor by hash only from 10 MiB up (smaller ones are sent whole each time):
the model here has wide layers (F16, hidden 2048, FFN 8192: its FFN tensors are 32 MiB) so
that most of B's bytes are in such tensors, and the test checks what the second placement
sent against the first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from libs.cluster import runfile
from libs.models.gguf_info import sha256_of
from libs.runtime.procs import ServiceProcess
from tests.e2e.cluster import RunningCluster
from tests.e2e.test_two_hosts import hosts, pytestmark, run_in, stop_all  # noqa: F401
from tests.made_models import llama_server, make_gguf

MEMORY_GB = "2"
PROMPT, TOKENS = "The sky is", 8
#: Through the gateway: the model's greedy text (random weights), as JSON.
ASK = (
    "import json, sys, openai; c = openai.OpenAI(base_url=sys.argv[1], api_key='-');"
    f"r = c.completions.create(model=sys.argv[2], prompt={PROMPT!r}, max_tokens={TOKENS},"
    " temperature=0); print(json.dumps(r.choices[0].text))"
)


def received(on_b: list[str], port: int) -> int:
    """Bytes B has received on the connections to its RPC listener open now (``ss``)."""
    out = subprocess.run(
        [*on_b, "ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out))


def cached(folder: Path) -> dict[str, int]:
    """The RPC server's cache: file name → size."""
    return {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def wait_unplaced(on_b: list[str], port: int, timeout_s: float = 60.0) -> None:
    """Until no connection to B's RPC listener is left (the head's llama-server stopped)."""
    deadline = time.monotonic() + timeout_s
    while received(on_b, port) and time.monotonic() < deadline:
        time.sleep(0.5)


def test_a_model_added_on_host_a_is_split_to_b_which_caches_its_part(
    hosts: tuple[list[str], str, list[str]],  # noqa: F811 - the fixture of test_two_hosts
    tmp_path: Path,
) -> None:
    on_a, address, on_b = hosts
    files = tmp_path / "host-a-files"
    files.mkdir()
    model = make_gguf(
        files / "wide.gguf", "llama", "F16", layers=2, hidden=2048, heads=16, kv_heads=4, ffn=8192
    )
    a_cache, b_cache = tmp_path / "a-models", tmp_path / "b-models"
    head = RunningCluster(
        "--listen", address, "--workers", "1",
        env={"TESSERA_WORKER_MEMORY_GB": MEMORY_GB, "TESSERA_MODEL_DIR": str(a_cache)},
        prefix=on_a,
    )  # fmt: skip
    # Host B: its own network and, over the folder of A's file, an empty one of its own.
    on_b_hidden = [
        *on_b, "unshare", "-m", "--propagation", "private",
        "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(files),
    ]  # fmt: skip
    joined: list[ServiceProcess] = []
    try:
        url, token = head.join_command()
        argv = [
            "-m", "libs.cli.main", "join", url, "--token", token, "--device-id", "laptop-b",
            "--memory-gb", MEMORY_GB,
        ]  # fmt: skip
        joined.append(
            ServiceProcess(
                "join laptop-b",
                {"COLUMNS": "200", "TESSERA_MODEL_DIR": str(b_cache)},
                argv,
                prefix=on_b_hidden,
                ready_line=lambda line: "ready: this host serves" in str(line.get("msg", "")),
            ).start(ready_timeout_s=180)
        )
        assert subprocess.run([*on_b_hidden, "test", "-e", str(model)]).returncode != 0
        assert any("engines: CPU workers run llama.cpp" in line for line in head.lines)
        said_b = [str(line.get("msg")) for line in joined[0].lines]
        assert any("as device laptop-b" in m and "engine llamacpp" in m for m in said_b), said_b
        with llama_server(model) as reference:
            expected = reference.completion(PROMPT, TOKENS)["content"]
        said_b = " ".join(str(line.get("msg")) for line in joined[0].lines)
        listens = re.search(r"rpc server up endpoint=[\d.]+:(\d+)", said_b)
        assert listens, said_b
        port = int(listens[1])

        on_head = {"TESSERA_RUN_FILE": str(head.run_file)}
        cli = ("-m", "libs.cli.main")
        scheduler = str(runfile.read(head.run_file)["scheduler_url"])
        remove = "import httpx, sys; httpx.delete(sys.argv[1]).raise_for_status()"
        # `tessera up` deployed the shipped model on worker-0: this test's model heads there.
        run_in(on_a, {}, "-c", remove, f"{scheduler}/placements/smollm2-135m-instruct")
        wait_unplaced(on_b, port)
        run_in(on_a, on_head, *cli, "models", "add", str(model), "--name", "wide")
        deploy = (*cli, "deploy", "wide", "--devices", "worker-0,laptop-b")
        placed = run_in(on_a, on_head, *deploy, "--id", "first")
        assert "worker-0" in placed and "laptop-b" in placed, placed
        assert json.loads(run_in(on_a, {}, "-c", ASK, f"{head.base_url}/v1", "wide")) == expected
        first = received(on_b, port)
        rpc_cache = b_cache / "llama-rpc"
        after_first = cached(rpc_cache)

        run_in(on_a, {}, "-c", remove, f"{scheduler}/placements/first")
        wait_unplaced(on_b, port)
        placed = run_in(on_a, on_head, *deploy, "--id", "second")
        assert "laptop-b" in placed, placed
        assert json.loads(run_in(on_a, {}, "-c", ASK, f"{head.base_url}/v1", "wide")) == expected
        second = received(on_b, port)

        report = {"first_bytes": first, "second_bytes": second, "cached": sum(after_first.values())}
        print(json.dumps(report))
        # B received its part (the tied output matrix and layer 1: ~300 MB) the first time...
        assert first > 200e6, report
        assert sum(after_first.values()) > 150e6, report
        # ...and the second time only what llama.cpp never caches (tensors under 10 MiB).
        assert second < 0.15 * first, report
        assert cached(rpc_cache) == after_first  # nothing new cached: nothing new sent
        # B never held the model's file: not in its model cache, and A's folder hidden.
        assert not (b_cache / "gguf").exists() or not list((b_cache / "gguf").glob("*.gguf"))

        # At the head of a placement, B's worker reads the file itself: A's worker, which
        # holds it, lends it (checked into B's cache; the object store is the fallback).
        run_in(on_a, {}, "-c", remove, f"{scheduler}/placements/second")
        wait_unplaced(on_b, port)
        head_b = (*cli, "deploy", "wide", "--devices", "laptop-b,worker-0", "--id", "third")
        placed = run_in(on_a, on_head, *head_b)
        assert "laptop-b" in placed, placed
        assert json.loads(run_in(on_a, {}, "-c", ASK, f"{head.base_url}/v1", "wide")) == expected
        sha256 = sha256_of(model)
        assert sha256_of(b_cache / "gguf" / f"{sha256}.gguf") == sha256
        said_b = " ".join(str(line.get("msg")) for line in joined[0].lines)
        assert re.findall(r"weights received lender=(\S+)", said_b) == ["worker-0"], said_b

        # Whole on B, from the file B now holds.
        run_in(on_a, {}, "-c", remove, f"{scheduler}/placements/third")
        whole_b = (*cli, "deploy", "wide", "--devices", "laptop-b", "--shards", "1")
        placed = run_in(on_a, on_head, *whole_b, "--id", "fourth")
        assert "laptop-b" in placed and "worker-0" not in placed, placed
        assert json.loads(run_in(on_a, {}, "-c", ASK, f"{head.base_url}/v1", "wide")) == expected
    finally:
        stop_all(joined)
        head.stop()
        warned = [line for line in head.lines if "error" in line or "warning" in line]
        print("\n".join(warned[-20:]), file=sys.stderr)
