"""Two hosts on this machine: two network namespaces joined by a veth pair, each with its own
address and no loopback between them. ``tessera up --listen`` runs in one and ``tessera join``
in the other (finding the cluster over mDNS), as a user would on two machines, NATS over TLS
(the cluster's own CA, handed to the joining host as the join command says); the joined host
serves shards of a model split across both hosts, and the greedy tokens equal the whole
model's; when the joined host's link goes down mid-stream, the stream completes on the workers
that remain; Ctrl-C on a joined host moves its shards before it exits, and nothing is lost;
the head stopped and started again on its home finds the joined host back by itself."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from libs.cluster.links import end_host
from libs.models.chat import encode_chat
from libs.models.shipped import prepare
from libs.runtime.procs import ServiceProcess
from services.worker.torch.shard import ShardModel, greedy
from tests.certificates import write_certificates
from tests.e2e.cluster import RunningCluster

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="two hosts need network namespaces: root and iproute2",
)
MODEL = "smollm2-135m-instruct"
#: Neither host can hold the whole model (int8 ~0.48 GB with its cache): it is split. With
#: llama.cpp it is counted as its GGUF with 8 slots' KV cache: 0.72 GB whole, 0.50 a half.
MEMORY_GB = "0.45"
LLAMA_MEMORY_GB = "0.6"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
#: The torch shard engine, asked for on both ends (the default is llama.cpp where built).
TORCH = ("--engine", "torch")
TOKENS = 24


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def hosts(uid: str) -> Iterator[tuple[list[str], str, list[str]]]:
    """(command prefix of host A, A's address, command prefix of host B)."""
    a, b = f"ta{uid[-5:]}", f"tb{uid[-5:]}"
    subnet = f"10.{200 + int(uid[-2:], 16) % 50}.{int(uid[-4:-2], 16)}"
    ip("netns", "add", a)
    ip("netns", "add", b)
    try:
        ip("link", "add", f"v{a}", "type", "veth", "peer", "name", f"v{b}")
        for ns, end, host in ((a, f"v{a}", 1), (b, f"v{b}", 2)):
            ip("link", "set", end, "netns", ns)
            ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", end)
            ip("-n", ns, "link", "set", end, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ["ip", "netns", "exec", a], f"{subnet}.1", ["ip", "netns", "exec", b]
    finally:
        # Both hosts switched off. After the link-down test a socat connection of the llama.cpp
        # split's TLS tunnel was left running: forked by the tunnel's listener (which dies with
        # its worker, the connection does not), it waits on the dead link for TCP to give up,
        # and deleting a namespace leaves what runs in it running.
        for ns in (a, b):
            for command in end_host(ns):
                print(f"{ns}: still running at the end, killed: {command}")


def tls_files(folder: Path, address: str) -> dict[str, str]:
    """A CA of the cluster's own and a certificate for NATS at ``address``, as settings."""
    files = write_certificates(folder, address)
    return {
        "TESSERA_NATS_CA": str(files["ca"]),
        "TESSERA_NATS_TLS_CERT": str(files["cert"]),
        "TESSERA_NATS_TLS_KEY": str(files["key"]),
    }


def reference_text() -> str:
    """The whole model's greedy answer, in the workers' precision (int8), in this process."""
    folder = prepare()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = encode_chat(tokenizer, QUESTION)
    model = ShardModel(folder, 0, 30, "int8")
    tokens = greedy(model, ids, TOKENS, {tokenizer.eos_token_id})
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def stream_and(
    prefix: list[str], url: str, command: list[str], code: str = ""
) -> list[tuple[float, str]]:
    """A greedy answer streamed on host ``prefix`` (``code``: ``STREAM``'s unless given),
    running ``command`` after its 4th piece; each piece with when it arrived."""
    stream = subprocess.Popen(
        [*prefix, sys.executable, "-c", code or STREAM, url], stdout=subprocess.PIPE, text=True
    )
    assert stream.stdout is not None
    pieces = []
    for line in stream.stdout:
        at, piece = json.loads(line)
        pieces.append((at, piece))
        if len(pieces) == 4:
            subprocess.run(command, check=True)
    assert stream.wait(timeout=60) == 0
    return pieces


def wait_alive(prefix: list[str], env: dict[str, str], device_id: str) -> None:
    """Until ``tessera devices`` on that host lists ``device_id`` alive."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = json.loads(run_in(prefix, env, "-m", "libs.cli.main", "devices", "--json"))
        if any(r["device_id"] == device_id and r["state"] == "alive" for r in rows):
            return
        time.sleep(1.0)
    raise AssertionError(f"{device_id} not alive again within 60 s")


def stop_all(processes: list[ServiceProcess]) -> None:
    """Ctrl-C on every joined host at once: each serves on while its shards move (up to 20 s,
    or never where its link is down), so one after the other would add those waits up."""
    for process in processes:
        if process.process is not None and process.process.poll() is None:
            process.process.send_signal(signal.SIGINT)
    for process in processes:
        if process.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.process.wait(timeout=45)  # join stops its worker within 30 s
        process.stop(timeout_s=5)


def run_in(prefix: list[str], env: dict[str, str], *argv: str) -> str:
    done = subprocess.run(
        [*prefix, sys.executable, *argv],
        env={**os.environ, **env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def stream_code(tokens: int) -> str:
    """A streaming greedy request of ``tokens`` through the gateway at argv[1]: one JSON line
    per piece."""
    return (
        "import json, sys, time, openai; c = openai.OpenAI(base_url=sys.argv[1], api_key='-');"
        f"s = c.chat.completions.create(model='{MODEL}', messages={QUESTION!r},"
        f" max_tokens={tokens}, temperature=0, stream=True)\n"
        "for k in s:\n"
        "    if k.choices and k.choices[0].delta.content:\n"
        "        print(json.dumps([time.monotonic(), k.choices[0].delta.content]), flush=True)"
    )


STREAM = stream_code(TOKENS)


def joins(
    prefix: list[str], url: str | None, token: str, device_id: str, *extra: str
) -> ServiceProcess:
    """``tessera join`` on the host ``prefix`` runs on, once it serves (``url`` None: the
    cluster is found over mDNS)."""
    where = [url] if url else []
    process = ServiceProcess(
        f"join {device_id}",
        {"COLUMNS": "200"},
        ["-m", "libs.cli.main", "join", *where, "--token", token, "--device-id", device_id, *extra],
        prefix=prefix,
        ready_line=lambda line: "ready: this host serves" in str(line.get("msg", "")),
    )
    return process.start(ready_timeout_s=180)


@pytest.mark.alone  # how soon host B is back after the restart is the check
def test_a_joined_host_serves_shards_of_a_model_split_across_both_hosts(
    hosts: tuple[list[str], str, list[str]], tmp_path: Path
) -> None:
    on_a, address, on_b = hosts
    tls = tls_files(tmp_path, address)
    head = RunningCluster(
        "--listen", address, "--workers", "1", *TORCH,
        env={"TESSERA_WORKER_MEMORY_GB": MEMORY_GB, **tls},
        prefix=on_a,
    )  # fmt: skip
    joined: list[ServiceProcess] = []
    try:
        said = head.wait_for("other hosts join with:", 60)
        found = re.search(r"tessera join (\S+) --token (\S+) --ca (\S+)", said)
        assert found, said  # the command names the CA the joining host must trust
        url, token, ca = found.groups()
        assert url.startswith(f"nats://{address}:") and ca == tls["TESSERA_NATS_CA"]
        head.wait_for("ready:", 240)
        # The model does not fit worker-0 alone: once the scheduler sees it, up stops trying.
        assert any("once more devices join" in line for line in head.lines), head.lines[-10:]
        assert any("announced on the LAN (mDNS)" in line for line in head.lines)
        # Host B is given no URL: it finds the cluster over mDNS.
        joined.append(
            joins(on_b, None, token, "laptop-b", "--memory-gb", MEMORY_GB, "--ca", ca, *TORCH)
        )
        said_b = [str(line.get("msg")) for line in joined[0].lines]
        assert any(f"found {url} on the LAN" in line for line in said_b)
        assert any("as device laptop-b (TLS)" in line for line in said_b), said_b

        on_head = {"TESSERA_RUN_FILE": str(head.run_file)}
        rows = json.loads(run_in(on_a, on_head, "-m", "libs.cli.main", "devices", "--json"))
        laptop = next(r for r in rows if r["device_id"] == "laptop-b")
        assert laptop["state"] == "alive"
        # Its own memory (this machine's), though it offers the cluster only MEMORY_GB of it.
        assert laptop["sample"]["memory_total_gb"] > 4 * float(MEMORY_GB)
        assert laptop["sample"]["memory_available_gb"] <= float(MEMORY_GB)
        deployed = run_in(on_a, on_head, "-m", "libs.cli.main", "deploy", MODEL, "--id", MODEL)
        assert "worker-0" in deployed and "laptop-b" in deployed, deployed

        reference = reference_text()
        streamed = run_in(on_a, {}, "-c", STREAM, f"{head.base_url}/v1").splitlines()
        assert "".join(json.loads(line)[1] for line in streamed) == reference

        # A spare worker joins on host A; host B's link goes down mid-stream.
        joined.append(joins(on_a, url, token, "spare-a", "--ca", ca, *TORCH))
        link = f"v{hosts[2][-1]}"
        pieces = stream_and(on_a, f"{head.base_url}/v1", [*on_b, "ip", "link", "set", link, "down"])
        assert "".join(p for _, p in pieces) == reference  # nothing lost, nothing twice
        down_at = pieces[3][0]
        # How soon is a figure to report (the goal: 3 heartbeat intervals + 1 s = 4 s), not
        # asserted: this machine is shared and noisy.
        recovered_s = pieces[4][0] - down_at
        print(f"the first piece after the link went down came {recovered_s:.2f} s later")

        # Host B's link comes back: laptop-b is a device again. Then Ctrl-C on the spare
        # mid-stream: its shards move while it still serves, and only then does it exit.
        subprocess.run([*on_b, "ip", "link", "set", link, "up"], check=True)
        wait_alive(on_a, on_head, "laptop-b")
        spare = joined[1]
        assert spare.process is not None
        ctrl_c = ["kill", "-INT", str(spare.process.pid)]
        pieces = stream_and(on_a, f"{head.base_url}/v1", ctrl_c)
        assert "".join(p for _, p in pieces) == reference
        assert spare.process.wait(timeout=120) == 0  # a bound (a shared machine), not a goal
        said = [str(line.get("msg", "")) for line in spare.lines]
        left = [m for m in said if "left" in m and "device_id=spare-a" in m]
        assert left and "before its shards moved" not in left[0], said[-20:]
        gap = max(later[0] - earlier[0] for earlier, later in itertools.pairwise(pieces))
        print(f"the spare: {left[0].strip()}; longest wait between pieces {gap:.2f} s")

        # The head stops (SIGTERM) and starts again on its home. Host B is left as it is: its
        # worker reconnects by itself with the password it keeps, and laptop-b is back in
        # `tessera devices` within 15 s of ready, with no command run on host B.
        seen = len(joined[0].lines)
        head.stop()
        head = RunningCluster(
            "--listen", address, "--workers", "1", *TORCH,
            env={"TESSERA_WORKER_MEMORY_GB": MEMORY_GB, **tls},
            prefix=on_a, home=head.home, port=head.port,
        )  # fmt: skip
        again = re.search(
            r"tessera join (\S+) --token (\S+) --ca (\S+)",
            head.wait_for("other hosts join with:", 60),
        )
        assert again and again.groups() == found.groups()  # the same address, token and CA
        head.wait_for("ready:", 240)
        ready_at = time.monotonic()
        wait_alive(on_a, {"TESSERA_RUN_FILE": str(head.run_file)}, "laptop-b")
        back_s = time.monotonic() - ready_at
        print(f"laptop-b back in `tessera devices` {back_s:.2f} s after ready")
        assert back_s <= 15.0
        assert joined[0].process is not None and joined[0].process.poll() is None
        after = [str(line.get("msg", "")) for line in joined[0].lines[seen:]]
        assert not [m for m in after if "joined" in m], after  # it did not join again
        streamed = run_in(on_a, {}, "-c", STREAM, f"{head.base_url}/v1").splitlines()
        assert "".join(json.loads(line)[1] for line in streamed) == reference
    finally:
        stop_all(joined)
        head.stop()


def test_llama_cpp_splits_across_both_hosts_and_survives_the_link_going_down(
    hosts: tuple[list[str], str, list[str]],
) -> None:
    """The same two hosts with the llamacpp engine on both: the head of the split runs
    llama.cpp's server and the other host's RPC server holds its layers, reached only through
    the mutual-TLS channel on that host's address (certificates of the cluster's CA, the joined
    host's issued at join; ``tests/integration/test_rpc_channel.py`` tries the ways around
    it); the joined host's link goes down mid-stream and the answer completes identical on the
    workers that remain."""
    on_a, address, on_b = hosts
    head = RunningCluster(
        "--listen", address, "--workers", "1", "--engine", "llamacpp",
        env={"TESSERA_WORKER_MEMORY_GB": LLAMA_MEMORY_GB},
        prefix=on_a,
    )  # fmt: skip
    joined: list[ServiceProcess] = []
    try:
        url, token = head.join_command()
        llama = ("--engine", "llamacpp")
        joined.append(joins(on_b, url, token, "laptop-b", "--memory-gb", LLAMA_MEMORY_GB, *llama))
        said_b = [str(line.get("msg")) for line in joined[0].lines]
        b_address = address.rsplit(".", 1)[0] + ".2"
        assert any(f"RPC server listens on {b_address} (mutual TLS" in line for line in said_b)
        on_head = {"TESSERA_RUN_FILE": str(head.run_file)}
        deployed = run_in(on_a, on_head, "-m", "libs.cli.main", "deploy", MODEL, "--id", MODEL)
        assert "worker-0" in deployed and "laptop-b" in deployed, deployed
        # llama.cpp streams fast: a long answer, so that the link goes down mid-stream.
        code = stream_code(128)
        streamed = run_in(on_a, {}, "-c", code, f"{head.base_url}/v1").splitlines()
        answer = "".join(json.loads(line)[1] for line in streamed)
        assert len(streamed) > 40, answer

        joined.append(joins(on_a, url, token, "spare-a", *llama))
        link = f"v{hosts[2][-1]}"
        down = [*on_b, "ip", "link", "set", link, "down"]
        pieces = stream_and(on_a, f"{head.base_url}/v1", down, code)
        assert "".join(p for _, p in pieces) == answer  # nothing lost, nothing twice
        # The answer finished on the new placement (host A's workers alone), not on laptop-b.
        placed = run_in(on_a, on_head, "-m", "libs.cli.main", "placements")
        assert "(epoch 2)" in placed and "laptop-b" not in placed, placed
        gap = max(later[0] - earlier[0] for earlier, later in itertools.pairwise(pieces[3:]))
        print(f"llama.cpp: the longest wait between pieces after the link went down {gap:.2f} s")
    finally:
        stop_all(joined)
        head.stop()
