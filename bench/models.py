"""A user's own model through the cluster: its weights delivered to a second host, and its
serving speed whole, split in 2, and on llama.cpp's own server.

- ``delivery`` (needs root: two network namespaces joined by a veth pair, as
  ``tests/e2e/test_two_hosts.py``): a generated GGUF of ``--size-gb`` on host A is put into the
  ``TESSERA_MODELS`` object store of a nats-server there (``libs/weights/whole_files.publish``, as
  ``tessera models add`` does) and lent by A's ``Lender`` (``libs/weights/lending.py``, as a
  worker on A runs it); host B fetches it into its own cache as a worker does (``ensure_local``:
  checked, then renamed into place), lent by A (``lent``: the delivery a worker gets where a
  device holds the file, in ``--streams`` stripes, each chunk checked against the store's index:
  a worker's host takes one per two cores, up to four; ``lent_1``: one connection, the file
  hashed whole, as before stripes and as a host with fewer than four cores takes it) and from
  the object store alone (``store``: no device lends it): MB/s. The reference is the same bytes
  copied raw through the same link: a TCP socket on A sending the file (``sendfile``), a
  receiver on B writing it to disk. ``ratio_lent_raw`` is the delivery's share of the raw copy's
  rate (goal ≥ 0.8), ``ratio_lent_1_stream_raw`` and ``ratio_store_raw`` the others'. Each round
  runs the four in turn (each first once in four rounds, after a ``sync``), the medians are
  reported with each round. Over each of ``--links``: the veth as fast as the cores copy
  (``none``: the link is the machine's memory, and both hosts share its cores), and held to a
  LAN's rate by ``tc`` (``10gbit``, ``5gbit``, ``2.5gbit``), as between two machines.
- ``serving`` (the llamacpp engine): the same model registered and deployed in a ``tessera up``
  with one CPU worker (whole) and with two (split in 2, ``--devices worker-0,worker-1``), and
  llama.cpp's server started directly on the file as the worker starts it; greedy 64-token chat
  streams at 1 and 8 concurrent clients (``bench/serving.py``'s client; ``--requests`` streams
  per client, 4 at least at one), tokens/s. Whole and direct are up side by side and measured
  in turn each round (the order swaps every round); split runs after, on its own cluster.
  Medians over ``--rounds`` are reported, with each round and each round's ratio, and the
  machine's CPU in use while both sat idle (``idle_busy_cores``: what the idle cluster costs
  the direct runs).

    python bench/models.py --json [--size-gb 1.0] [--rounds 2] [--requests 2]
        [--links none,10gbit,5gbit,2.5gbit] [--streams N] [--skip-serving] [--skip-delivery]
        [--skip-split]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import add_results_option, table, write_report  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from libs.cluster.servers import find_nats_server  # noqa: E402
from libs.runtime.procs import free_port  # noqa: E402
from libs.weights.borrowing import default_streams  # noqa: E402

SUBNET = "10.231.7"
NS_A, NS_B = "tbench-a", "tbench-b"

#: On host B: fetch the model into B's cache as a worker does (``ensure_local``): lent by
#: host A's lender when a device id is given, else from A's object store; prints seconds.
FETCH = """
import asyncio, sys, time
from pathlib import Path
from types import SimpleNamespace
from libs.weights.whole_files import ensure_local
from libs.runtime.nats_client import close_nats, connect_nats
async def main():
    nc = await connect_nats(sys.argv[1], "bench-fetch")
    card = SimpleNamespace(name="bench", source="/not/on/host-b.gguf", sha256=sys.argv[2],
                           size_bytes=int(sys.argv[3]))
    started = time.perf_counter()
    await ensure_local(nc, card, cache_dir=Path(sys.argv[4]), device_id=sys.argv[5] or None,
                       streams=int(sys.argv[6]) or None)
    print(time.perf_counter() - started)
    await close_nats(nc)
asyncio.run(main())
"""
#: On host A: what a worker there runs: the file known to be the model's (as ``models add``
#: notes it), lent by ``Lender`` on A's address until stdin closes.
LEND = """
import asyncio, sys
from pathlib import Path
from libs.weights.lending import Lender
from libs.weights.local_files import mark_verified
from libs.runtime.nats_client import close_nats, connect_nats
async def main():
    cache = Path(sys.argv[5])
    mark_verified(Path(sys.argv[3]), sys.argv[4], cache)
    nc = await connect_nats(sys.argv[1], "bench-lender")
    lender = Lender(nc, "host-a", sys.argv[2], cache_dir=cache)
    await lender.start()
    await nc.flush()
    print("lending", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await lender.close()
    await close_nats(nc)
asyncio.run(main())
"""
#: On host A: publish the file; prints seconds.
PUBLISH = """
import asyncio, sys, time
from pathlib import Path
from libs.weights.whole_files import publish_to
started = time.perf_counter()
asyncio.run(publish_to(sys.argv[1], None, Path(sys.argv[2]), sys.argv[3]))
print(time.perf_counter() - started)
"""
#: On host A: send the file once to the first connection (raw TCP).
SEND = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    with conn, open(sys.argv[3], "rb") as f:
        conn.sendfile(f)
"""
#: On host B: receive into a file until EOF; prints seconds.
RECEIVE = """
import socket, sys, time
buf = bytearray(4 << 20); view = memoryview(buf)
started = time.perf_counter()
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s, open(sys.argv[3], "wb") as f:
    while n := s.recv_into(buf):
        f.write(view[:n])
print(time.perf_counter() - started)
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def make_hosts() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    sh("ip", "netns", "add", NS_A)
    sh("ip", "netns", "add", NS_B)
    sh("ip", "link", "add", "vtbench-a", "type", "veth", "peer", "name", "vtbench-b")
    for ns, end, host in ((NS_A, "vtbench-a", 1), (NS_B, "vtbench-b", 2)):
        sh("ip", "link", "set", end, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", end)
        sh("ip", "-n", ns, "link", "set", end, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def drop_hosts() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def on(ns: str, code: str, *args: str) -> float:
    """Run python ``code`` in namespace ``ns``; its last printed line as a float."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code, *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    return float(out.strip().splitlines()[-1])


def make_model(folder: Path, size_gb: float) -> tuple[Path, str]:
    from libs.models.gguf_info import sha256_of
    from tests.made_models import make_gguf

    path = make_gguf(
        folder / "bench.gguf", "llama", "Q8_0", layers=16, target_bytes=int(size_gb * 1e9)
    )
    return path, sha256_of(path)


def delivery(
    path: Path, sha256: str, rounds: int, work: Path, link: str, streams: int
) -> dict[str, object]:
    """Lent, store and raw copies of ``path`` from A to B over a veth pair, ``link`` its rate
    (``tc``'s token bucket on A's end: ``10gbit``, ``2.5gbit``; ``none``: as fast as the two
    cores copy)."""
    size = path.stat().st_size
    make_hosts()
    if link != "none":
        sh("ip", "netns", "exec", NS_A, "tc", "qdisc", "add", "dev", "vtbench-a", "root",
           "tbf", "rate", link, "burst", "8mb", "latency", "20ms")  # fmt: skip
    a = f"{SUBNET}.1"
    port = free_port()
    nats = subprocess.Popen(
        ["ip", "netns", "exec", NS_A, str(find_nats_server()), "-js", "-a", a, "-p", str(port),
         "-sd", str(work / "nats")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    lender = None
    runs: dict[str, list[float]] = {"lent": [], "lent_1": [], "store": [], "raw": []}
    try:
        url = f"nats://{a}:{port}"
        time.sleep(1.0)
        publish_s = on(NS_A, PUBLISH, url, str(path), sha256)
        lender = subprocess.Popen(
            ["ip", "netns", "exec", NS_A, sys.executable, "-c", LEND, url, a, str(path), sha256,
             str(work / "a-cache")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert lender.stdout is not None
        lender.stdout.readline()  # lending
        kinds = list(runs)
        for k in range(rounds):
            for kind in kinds[k % 4 :] + kinds[: k % 4]:  # each kind first in turn
                os.sync()  # each copy starts with no other's writes still going to disk
                runs[kind].append(copy(kind, path, sha256, url, a, work / f"b-{k}", streams))
            print(
                f"{link} round {k + 1}: "
                + ", ".join(f"{kind} {mb_s[-1]:.0f} MB/s" for kind, mb_s in runs.items()),
                file=sys.stderr,
            )
    finally:
        if lender is not None:
            lender.communicate(timeout=10)
        nats.terminate()
        nats.wait(timeout=10)
        drop_hosts()
    lent, lent_1, store, raw = (statistics.median(runs[kind]) for kind in kinds)
    return {
        "link": link,
        "model_bytes": size,
        "streams": streams,
        "host_default_streams": default_streams(),
        "publish_mb_s": round(size / 1e6 / publish_s, 1),
        "lent_fetch_mb_s": round(lent, 1),
        "lent_1_stream_mb_s": round(lent_1, 1),
        "store_fetch_mb_s": round(store, 1),
        "raw_tcp_mb_s": round(raw, 1),
        "ratio_lent_raw": round(lent / raw, 2),
        "ratio_lent_1_stream_raw": round(lent_1 / raw, 2),
        "ratio_store_raw": round(store / raw, 2),
        "rounds": {
            **{f"{kind}_mb_s": [round(x, 1) for x in mb_s] for kind, mb_s in runs.items()},
            "ratio_lent_raw": [
                round(x / r, 2) for x, r in zip(runs["lent"], runs["raw"], strict=True)
            ],
        },
    }


def copy(kind: str, path: Path, sha256: str, url: str, a: str, cache: Path, streams: int) -> float:
    """MB/s of one copy of ``path`` from A into B's ``cache`` (removed after)."""
    size = path.stat().st_size
    try:
        if kind == "raw":
            return raw_copy(path, a, cache)
        asker = "host-b" if kind.startswith("lent") else ""
        count = "1" if kind == "lent_1" else str(streams)
        return size / 1e6 / on(NS_B, FETCH, url, sha256, str(size), str(cache), asker, count)
    finally:
        subprocess.run(["rm", "-rf", str(cache)], check=True)


def raw_copy(path: Path, a: str, folder: Path) -> float:
    """MB/s of the file sent by ``sendfile`` on A and written to disk on B: the reference."""
    raw_port = str(free_port())
    sender = subprocess.Popen(
        ["ip", "netns", "exec", NS_A, sys.executable, "-c", SEND, a, raw_port, str(path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert sender.stdout is not None
    sender.stdout.readline()  # listening
    folder.mkdir(parents=True, exist_ok=True)
    mb_s = path.stat().st_size / 1e6 / on(NS_B, RECEIVE, a, raw_port, str(folder / "raw.bin"))
    sender.wait(timeout=60)
    return mb_s


# -- serving -------------------------------------------------------------------------------------
def cluster(workers: int, run_dir: Path) -> tuple[object, str, dict[str, str]]:
    from libs.runtime.procs import ServiceProcess

    port = free_port()
    env = {
        "TESSERA_WORKER_MEMORY_GB": "6",  # the model with 8 slots of KV cache: ~2.5 GB
        "TESSERA_CPU_ENGINE": "llamacpp",
        "TESSERA_GATEWAY_PORT": str(port),
        "TESSERA_SCHEDULER_HTTP_PORT": str(free_port()),
        "TESSERA_RUN_FILE": str(run_dir / "cluster.json"),
        "TESSERA_MODEL_DIR": str(run_dir / "models"),
        "TESSERA_HOME": str(run_dir / "home"),  # a new cluster each run
    }
    argv = ["-m", "libs.cli.main", "up", "--workers", str(workers), "--engine", "llamacpp"]
    ready = lambda line: "ready:" in str(line.get("msg", ""))  # noqa: E731
    child = ServiceProcess("tessera up", env, argv, ready_line=ready).start(ready_timeout_s=300)
    return child, f"http://127.0.0.1:{port}/v1", env


def cli(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", *argv],
        env={**os.environ, **env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tessera {' '.join(argv)}: {done.stdout}{done.stderr}")
    return done.stdout


async def speeds(url: str, name: str, levels: list[int], requests: int) -> dict[str, float]:
    """Tokens/s at each concurrency: that many clients, ``requests`` streams each (at least
    4 at one client), after one warm-up stream."""
    from openai import AsyncOpenAI

    from bench.serving import measure

    rates = {}
    async with AsyncOpenAI(base_url=url, api_key="none", timeout=600) as client:
        await measure(client, "bench-model", 1, 1)  # warm-up
        for level in levels:
            result = await measure(client, "bench-model", level, max(requests, 4 // level))
            rates[str(level)] = round(result.rate, 1)
            print(f"{name}: c={level} {result.rate:.1f} tokens/s", file=sys.stderr)
    return rates


def tessera_up(path: Path, workers: int) -> tuple[object, str]:
    """A ``tessera up`` of ``workers`` CPU workers serving the model on all of them."""
    from libs.cluster import runfile

    run_dir = Path(tempfile.mkdtemp(prefix="bench-models-"))
    child, url, env = cluster(workers, run_dir)
    try:
        import httpx

        scheduler = str(runfile.read(run_dir / "cluster.json")["scheduler_url"])
        httpx.delete(f"{scheduler}/placements/smollm2-135m-instruct", timeout=30)
        cli(env, "models", "add", str(path), "--name", "bench-model")
        devices = ",".join(f"worker-{k}" for k in range(workers))
        cli(env, "deploy", "bench-model", "--devices", devices, "--id", "bench")
    except BaseException:
        child.stop(timeout_s=30)  # type: ignore[attr-defined]
        raise
    return child, url


def busy_cores(seconds: float = 5.0) -> float:
    """The machine's CPU in use over ``seconds`` (cores), from /proc/stat."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    cores = os.cpu_count() or 1
    return round(cores * (1 - (idle1 - idle0) / max(1, total1 - total0)), 3)


def side_by_side(path: Path, levels: list[int], requests: int, rounds: int) -> dict[str, object]:
    """Tessera whole and llama.cpp's server direct, both up, measured in turn each round
    (the order swaps every round, so drift falls on both alike)."""
    from libs.contracts import shard_ring
    from libs.models.gguf_info import read_card
    from services.worker.served.llama_worker import server_factory
    from services.worker.settings import WorkerSettings

    card = read_card(path, name="bench-model")
    [task] = shard_ring(
        "load", "direct", card.name, [("direct", 0, card.layers)], 0, 0.0, card=card
    )
    child, whole_url = tessera_up(path, 1)

    async def run() -> dict[str, object]:
        server = server_factory(WorkerSettings())(task)  # as the llamacpp worker starts it
        await server.start(300)
        try:
            urls = {"whole": whole_url, "llamacpp_direct": f"{server.url}/v1"}
            idle = await asyncio.to_thread(busy_cores)  # both up, neither asked anything
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
            for k in range(rounds):
                order = list(urls) if k % 2 == 0 else list(reversed(urls))
                for name in order:
                    runs[name].append(await speeds(urls[name], name, levels, requests))
            return {"idle_busy_cores": idle, "rounds": runs}
        finally:
            await server.stop()

    try:
        return asyncio.run(run())
    finally:
        child.stop(timeout_s=30)  # type: ignore[attr-defined]


def split_runs(path: Path, levels: list[int], requests: int, rounds: int) -> list[dict[str, float]]:
    child, url = tessera_up(path, 2)
    try:
        return [asyncio.run(speeds(url, "split_2", levels, requests)) for _ in range(rounds)]
    finally:
        child.stop(timeout_s=30)  # type: ignore[attr-defined]


def serving(path: Path, requests: int, rounds: int, split: bool) -> dict[str, object]:
    levels = [1, 8]
    started = time.monotonic()
    measured = side_by_side(path, levels, requests, rounds)
    runs: dict[str, list[dict[str, float]]] = measured["rounds"]  # type: ignore[assignment]
    if split:
        runs["split_2"] = split_runs(path, levels, requests, rounds)

    def median(name: str) -> dict[str, float]:
        return {str(n): round(statistics.median(r[str(n)] for r in runs[name]), 1) for n in levels}

    medians = {name: median(name) for name in runs}
    whole, llama = medians["whole"], medians["llamacpp_direct"]
    report: dict[str, object] = {
        "requests_per_client": requests,
        "tokens_per_s": medians,
        "rounds": runs,
        "idle_busy_cores": measured["idle_busy_cores"],
    }
    for n in levels:
        report[f"ratio_whole_direct_c{n}"] = round(whole[str(n)] / llama[str(n)], 2)
        report[f"ratio_whole_direct_c{n}_rounds"] = [
            round(w[str(n)] / d[str(n)], 2)
            for w, d in zip(runs["whole"], runs["llamacpp_direct"], strict=True)
        ]
    if split:
        report["ratio_split_whole_c8"] = round(medians["split_2"]["8"] / whole["8"], 2)
    report["seconds"] = round(time.monotonic() - started)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each half")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per level")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-delivery", action="store_true")
    parser.add_argument(
        "--links",
        default="none,10gbit,5gbit,2.5gbit",
        help="the rates of the link delivery is measured over (tc; none: unlimited)",
    )
    parser.add_argument("--skip-split", action="store_true", help="serve whole and direct only")
    parser.add_argument(
        "--streams",
        type=int,
        default=max(2, default_streams()),
        help="connections of the striped lent copy (default: a worker's here, at least 2)",
    )
    add_results_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    try:
        path, sha256 = make_model(work, args.size_gb)
        report: dict[str, object] = {"model": f"llama Q8_0, {path.stat().st_size / 1e9:.2f} GB"}
        if not args.skip_delivery:
            report["delivery"] = [
                delivery(path, sha256, args.rounds, work, link, args.streams)
                for link in args.links.split(",")
            ]
        if not args.skip_serving:
            report["serving"] = serving(path, args.requests, args.rounds, not args.skip_split)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    write_report(args.results, "models", "A user's own model through the cluster", table(report))
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
