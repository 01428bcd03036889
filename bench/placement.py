"""Placements measured on devices the kernel holds to their size: DWPS's choice against exo's,
llama.cpp's own split and the best of a set of candidates, each beside its prediction.

Each device of the fleet is a cgroup (``libs/cluster/limits.py``: a CPU quota and a memory
limit) on this machine, calibrated inside it as a held worker calibrates itself. A candidate
placement runs as a llama.cpp split does in Tessera: ``llama-server`` on the first device's
layers, inside that device's group; every other device's layers on its ``ggml-rpc-server``,
inside its own group. Each candidate is measured at 1 stream (the faster of two) and at
``--streams`` at once (decode tokens/s, after a warm-up), and predicted before it runs
(``libs/core/predict.py``) from its devices' speed and bandwidth calibrated again just before
(a shared machine's neighbours move both between candidates).

The candidates: DWPS's choice (what the scheduler's ``partition.choose`` picks from its
previews of this fleet, each split weighed by the predictor's step as the scheduler weighs a
llama.cpp split), exo's memory-proportional ring (``partition.memory_proportional``),
llama.cpp's default split (every device, layers in proportion to free memory), and a sample of
the other feasible contiguous splits (each device alone; each pair, fastest first, cut at a
quarter, a half and three quarters; the three in speed order, split by speed and evenly).

The link sweep: the two fastest devices, split as the scheduler splits them, their RPC traffic
through a relay that adds each round trip (``libs/cluster/relay.py``), against the model whole
on the fastest: which is faster measured, and which the scheduler chooses at that round trip.

    python bench/placement.py --json [--model FILE.gguf] [--fleet FILE.yaml|FILE.toml]

Needs root (cgroups) and ``make llama``. Watts are not predicted against a measurement here:
this machine has no power meter a cgroup can read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations, pairwise, permutations
from pathlib import Path

from report import add_results_option, table, write_report  # bench/ is the script's folder
from rpc_channel import one_stream

from libs.cluster.limits import Group, Limits, unavailable
from libs.cluster.relay import DelayRelay
from libs.contracts import Sampling, shard_ring
from libs.core import partition
from libs.core.catalogue import ModelSpec, card_spec
from libs.core.model import Device
from libs.core.predict import (
    Prediction,
    Stage,
    corrected,
    placement_step_ms,
    predict,
    stages_of,
)
from libs.devices.fleetfile import WorkerSpec, load_fleet, read_fleet_file
from libs.models.gguf_info import read_card
from libs.runtime.procs import free_port
from services.worker.rpc.channel import listening
from services.worker.rpc.server import llama_env
from services.worker.served.chat_templates import tool_template
from services.worker.served.llama_server import LlamaServer
from services.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
BINARIES = WorkerSettings().llama_bin
#: The default fleet: a laptop, a desktop and a NAS whose memory grows as its speed falls
#: (exo places by memory alone; the NAS holds the most). Links are not made here: the sweep
#: puts its own round trips on the split's RPC traffic.
DEFAULT_FLEET = REPO / "deploy" / "fleets" / "home.yaml"
#: What a device's memory limit must keep beside a model: llama.cpp's own buffers and the
#: process (GB).
PROCESS_GB = 0.3
CONTEXT = 256  # per request slot: the prompt and the answer
PROMPT = "Write a long story about a fox who finds a key in the snow."
READINGS = 3  # a device's speed and bandwidth: the median of its last calibrations
CALIBRATE = (
    "import json; from libs.devices.calibration import measure;"
    "c = measure(sustained_s=1.0);"  # as a held worker calibrates itself
    "print(json.dumps([c.fp32_gflops, c.memory_bandwidth_gbps]))"
)


@dataclass
class HeldDevice:
    spec: WorkerSpec
    group: Group
    gflops: float = 0.0
    bandwidth_gbps: float = 0.0
    rpc: subprocess.Popen[bytes] | None = None
    rpc_port: int = 0
    readings: list[tuple[float, float]] = field(default_factory=list)  # (GFLOP/s, GB/s)

    @property
    def id(self) -> str:
        return self.spec.id

    def device(self, rtt_ms: float = 0.1) -> Device:
        """The device as the scheduler's planner sees it."""
        free = max(0.0, self.spec.memory_gb - PROCESS_GB)
        return Device(
            device_id=self.id,
            device_class=self.spec.device_class,
            capability=(0.5, 0.5, 0.5, 0.5, 0.5),
            memory_total_gb=self.spec.memory_gb,
            memory_free_gb=free,
            power_max_w=30.0,
            power_now_w=5.0,
            power_idle_w=5.0,
            temperature_c=40.0,
            thermal_limit_c=90.0,
            delta_t_c=20.0,
            speed=self.gflops,
            memory_gbps=self.bandwidth_gbps,
            slots=8,
            network_rtt_ms=rtt_ms,
        )


@dataclass
class Candidate:
    name: str
    devices: tuple[str, ...]
    counts: tuple[int, ...]
    roles: list[str] = field(default_factory=list)
    predicted: Prediction | None = None
    stages: list[Stage] = field(default_factory=list)  # what the prediction read
    measured: dict[int, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return self.devices, self.counts


def run_in(group: Group, code: str) -> str:
    done = subprocess.run(
        [*group.prefix(), sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
             "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"in {group.name}: {done.stderr[-500:]}")
    return done.stdout


def calibrate(d: HeldDevice) -> None:
    """``d``'s speed and bandwidth measured again inside its group (a shared machine's
    neighbours change them: the prediction reads what holds now, as a host's probe would),
    each the median of its last ``READINGS`` (one second under a quota of a fraction of a
    core varies by half)."""
    d.readings.append(json.loads(run_in(d.group, CALIBRATE)))
    last = d.readings[-READINGS:]
    d.gflops = statistics.median(r[0] for r in last)
    d.bandwidth_gbps = statistics.median(r[1] for r in last)
    said = f"{d.id}: {d.spec.cpus:g} cores, {d.spec.memory_gb:g} GB: "
    print(f"{said}{d.gflops:.1f} GFLOP/s, {d.bandwidth_gbps:.1f} GB/s", file=sys.stderr)


@contextlib.contextmanager
def held_fleet(specs: Sequence[WorkerSpec], tag: str) -> Iterator[list[HeldDevice]]:
    """Each device's group, calibrated inside it, with its RPC server running there."""
    devices = [HeldDevice(s, Group(f"pl{tag}-{s.id}", Limits(s.cpus, s.memory_gb))) for s in specs]
    try:
        for d in devices:
            d.group.create()
            for _ in range(READINGS - 1):
                calibrate(d)
            d.rpc_port = free_port()
            command = [str(BINARIES / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(d.rpc_port)]
            d.rpc = subprocess.Popen(
                [*d.group.prefix(), *command, "-t", "1"], env=llama_env(),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(listening(d.rpc_port) for d in devices):
            if time.monotonic() > deadline:
                raise RuntimeError("an RPC server did not listen within 30 s")
            time.sleep(0.2)
        yield devices
    finally:
        for d in devices:
            if d.rpc is not None:
                d.rpc.kill()
                d.rpc.wait()
        time.sleep(0.5)
        for d in devices:
            with contextlib.suppress(RuntimeError):
                d.group.remove()


class HeldLlamaServer(LlamaServer):
    """llama-server inside the first device's group, given the RPC servers' addresses as they
    are (they run on this machine: no tunnels)."""

    def __init__(self, prefix: list[str], *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.prefix = prefix

    async def prepare(self) -> None:
        self.template = await asyncio.to_thread(tool_template, self.gguf)

    def command(self) -> tuple[list[str], dict[str, str]]:
        command, env = super().command()
        return [*self.prefix, *command], env


async def at_once(server: LlamaServer, prompt: list[int], tokens: int, n: int) -> float:
    """Aggregate decode tokens/s of ``n`` streams at once: the tokens all of them gave while
    every one was decoding (from the last first token to the first last one), per second."""
    times: list[list[float]] = []

    async def stream() -> None:
        seen: list[float] = []
        times.append(seen)
        async for _ in server.complete(prompt, Sampling(max_tokens=tokens), tokens):
            seen.append(time.perf_counter())

    await asyncio.gather(*(stream() for _ in range(n)))
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    given = sum(sum(1 for x in t if start < x <= end) for t in times)
    return given / (end - start) if end > start else float("nan")


async def measure(
    fleet: dict[str, HeldDevice],
    gguf: Path,
    layers: int,
    candidate: Candidate,
    prompt: list[int],
    args: argparse.Namespace,
    endpoints: dict[str, str] | None = None,
) -> dict[int, float]:
    """``candidate`` run and measured: decode tokens/s at 1 stream and at ``args.streams``."""
    shards, start = [], 0
    for device, count in zip(candidate.devices, candidate.counts, strict=True):
        shards.append((device, start, start + count))
        start += count
    addresses = endpoints or {}
    route = [addresses.get(d, f"127.0.0.1:{fleet[d].rpc_port}") for d in candidate.devices]
    task = shard_ring("load", "bench", gguf.stem, shards, 1, 0.0, None, route, CONTEXT)[0]
    head = fleet[candidate.devices[0]]
    server = HeldLlamaServer(
        head.group.prefix(), BINARIES, gguf, task, layers,
        threads=1, slots=args.streams, context=CONTEXT,
    )  # fmt: skip
    try:
        await server.start(300.0)
        await one_stream(server, prompt, 4)  # warm-up: first graphs, caches
        # the faster of two at one stream: a stream of the fastest device lasts a third of a
        # second, and a neighbour's pause once took a quarter off it (a shared machine only
        # ever slows a run); the streams at once last several seconds
        one = max([(await one_stream(server, prompt, args.tokens))[0] for _ in range(2)])
        many = await at_once(server, prompt, args.tokens, args.streams)
    finally:
        await server.stop()
    return {1: one, args.streams: many}


def fits(
    spec: ModelSpec, fleet: dict[str, HeldDevice], devices: Sequence[str], counts: Sequence[int]
) -> bool:
    start, n = 0, len(devices)
    for i, (device, count) in enumerate(zip(devices, counts, strict=True)):
        need = spec.shard_gb(count, i == 0, i == n - 1, CONTEXT, start)
        if count < 1 or need > fleet[device].device().memory_free_gb:
            return False
        start += count
    return True


def scheduler_choice(spec: ModelSpec, devices: Sequence[Device]) -> partition.Preview:
    """What the scheduler places on ``devices``: its llama.cpp candidates, chosen."""
    return partition.choose(partition.previews(spec, devices, CONTEXT, step=placement_step_ms))


def candidates(spec: ModelSpec, fleet: dict[str, HeldDevice]) -> tuple[list[Candidate], int]:
    """The named placements and the sampled others (deduplicated), and how many feasible
    contiguous splits there are in all (ordered devices, layer counts)."""
    devices = [d.device() for d in fleet.values()]
    by_speed = sorted(fleet, key=lambda i: -fleet[i].gflops)
    out: dict[tuple[tuple[str, ...], tuple[int, ...]], Candidate] = {}

    def add(name: str, ids: Sequence[str], counts: Sequence[int]) -> None:
        if not fits(spec, fleet, ids, counts):
            return
        key = (tuple(ids), tuple(counts))
        out.setdefault(key, Candidate(name, tuple(ids), tuple(counts))).roles.append(name)

    dwps = scheduler_choice(spec, devices)
    if dwps.feasible:
        add("dwps", dwps.devices, [s.layers for s in dwps.shards])
    exo = partition.memory_proportional(spec, devices, CONTEXT)
    if exo.feasible:
        add("exo", exo.devices, [s.layers for s in exo.shards])
    memory = [fleet[i].device().memory_free_gb for i in by_speed]
    add("llama.cpp default", by_speed, partition.largest_remainder(spec.layers, memory))
    L = spec.layers
    for i in by_speed:
        add(f"{i} whole", [i], [L])
    for a_index, a in enumerate(by_speed):
        for b in by_speed[a_index + 1 :]:
            for share in (0.25, 0.5, 0.75):
                cut = min(L - 1, max(1, round(L * share)))
                add(f"{a}+{b} {cut}/{L - cut}", [a, b], [cut, L - cut])
    speeds = [fleet[i].gflops for i in by_speed]
    add("all by speed", by_speed, partition.largest_remainder(L, speeds))
    add("all even", by_speed, partition.largest_remainder(L, [1.0] * len(by_speed)))
    return list(out.values()), feasible_count(spec, fleet)


def feasible_count(spec: ModelSpec, fleet: dict[str, HeldDevice]) -> int:
    """Feasible contiguous splits over every ordered subset of the fleet (counted, not run)."""

    def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
        for cuts in combinations(range(1, total), parts - 1):
            edges = (0, *cuts, total)
            yield tuple(b - a for a, b in pairwise(edges))

    count = 0
    for k in range(1, len(fleet) + 1):
        for ids in permutations(fleet, k):
            count += sum(fits(spec, fleet, ids, c) for c in compositions(spec.layers, k))
    return count


def error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


async def run(
    args: argparse.Namespace, specs: Sequence[WorkerSpec], gguf: Path
) -> dict[str, object]:
    from transformers import AutoTokenizer

    from libs.models.chat import encode_chat
    from libs.models.shipped import prepare

    card = read_card(gguf, checksum=False)
    spec = card_spec(card, "llamacpp", args.streams)
    tokenizer = AutoTokenizer.from_pretrained(prepare())  # the made models use SmolLM2's
    prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    with held_fleet(specs, secrets.token_hex(3)) as held:
        fleet = {d.id: d for d in held}
        chosen, total = candidates(spec, fleet)
        if args.named_only:
            named = {"dwps", "exo", "llama.cpp default"}
            chosen = [c for c in chosen if named & set(c.roles)]
        if not any("dwps" in c.roles for c in chosen):
            devices = [d.device() for d in held]
            why = scheduler_choice(spec, devices).reason
            raise SystemExit(f"placement bench: no placement of this model on this fleet ({why})")
        ordered = sorted(chosen, key=lambda c: "dwps" not in c.roles)  # DWPS's first: it corrects
        factors: dict[int, dict[str, float]] = {}
        for n, c in enumerate(ordered, 1):
            print(f"[{n}/{len(ordered)}] {c.name}: {c.devices} {c.counts}", file=sys.stderr)
            for device in c.devices:
                calibrate(fleet[device])
            # its RPC servers run on this machine: no link
            c.stages = stages_of([fleet[d].device(0.0) for d in c.devices], c.counts)
            c.predicted = predict(spec, c.stages, (1, args.streams))
            c.measured = await measure(fleet, gguf, card.layers, c, prompt, args)
            if n == 1:  # the model corrects itself from this one deployment's measurements
                for load in (1, args.streams):
                    factors[load] = corrected(
                        {}, c.stages, c.predicted.tokens_per_s[load], c.measured[load], spec.name
                    )
        sweep = await link_sweep(args, spec, fleet, gguf, card.layers, prompt)
    return summary(args, spec, fleet, ordered, factors, total, sweep)


async def link_sweep(
    args: argparse.Namespace,
    spec: ModelSpec,
    fleet: dict[str, HeldDevice],
    gguf: Path,
    layers: int,
    prompt: list[int],
) -> list[dict[str, object]]:
    """The two fastest split (as the scheduler splits them) over a link of each round trip,
    against the model whole on the fastest."""
    if len(fleet) < 2:
        return []
    fast, second = sorted(fleet, key=lambda i: -fleet[i].gflops)[:2]
    if not fits(spec, fleet, [fast], [spec.layers]):  # nothing to compare a split with
        print(f"no sweep: the model does not fit {fast} whole", file=sys.stderr)
        return []
    whole = Candidate("whole", (fast,), (spec.layers,))
    whole_rate = (await measure(fleet, gguf, layers, whole, prompt, args))[1]
    out = []
    for rtt in args.sweep:
        devices = [fleet[fast].device(), fleet[second].device(rtt)]
        pair = partition.plan(spec, devices, CONTEXT, placement_step_ms)
        options = [partition.plan(spec, devices[:1], CONTEXT, placement_step_ms), pair]
        chosen = partition.choose(options)
        split = Candidate("split", pair.devices, tuple(s.layers for s in pair.shards))
        relay = DelayRelay("127.0.0.1", ("127.0.0.1", fleet[second].rpc_port), rtt / 2)
        port = await relay.start()
        try:
            split_rate = (
                await measure(
                    fleet, gguf, layers, split, prompt, args, {second: f"127.0.0.1:{port}"}
                )
            )[1]
        finally:
            await relay.close()
        faster = "split" if split_rate > whole_rate else "whole"
        out.append({
            "rtt_ms": rtt, "split_counts": list(split.counts),
            "split_tokens_per_s": round(split_rate, 2), "whole_tokens_per_s": round(whole_rate, 2),
            "faster": faster, "chosen": "split" if len(chosen.devices) > 1 else "whole",
        })  # fmt: skip
        print(
            f"sweep {rtt} ms: split {split_rate:.2f}, whole {whole_rate:.2f} tokens/s",
            file=sys.stderr,
        )
    return out


def summary(
    args: argparse.Namespace,
    spec: ModelSpec,
    fleet: dict[str, HeldDevice],
    placed: list[Candidate],
    factors: dict[int, dict[str, float]],
    total: int,
    sweep: list[dict[str, object]],
) -> dict[str, object]:
    loads = (1, args.streams)
    label = {1: "c1", args.streams: f"c{args.streams}"}
    dwps = next(c for c in placed if "dwps" in c.roles)
    exo = next((c for c in placed if "exo" in c.roles), None)
    best = {n: max(c.measured[n] for c in placed) for n in loads}
    errors, after, sizes_only = [], [], []
    untyped = replace(spec, layer_types=(), output_type="")  # one share for every type
    for c in placed:
        assert c.predicted is not None
        stages = c.stages  # as the device read when it was predicted
        for n in loads:
            errors.append(error(c.predicted.tokens_per_s[n], c.measured[n]))
            plain = predict(untyped, stages, (n,)).tokens_per_s[n]
            sizes_only.append(error(plain, c.measured[n]))
            if c is not dwps:  # the one it corrected from is not counted
                again = predict(spec, stages, (n,), factors=factors[n])
                after.append(error(again.tokens_per_s[n], c.measured[n]))
    rows = []
    for c in placed:
        assert c.predicted is not None
        parts = zip(c.devices, c.counts, strict=True)
        row: dict[str, object] = {
            "placement": " + ".join(f"{d}:{k}" for d, k in parts),
            "as": ", ".join(c.roles),
        }
        for n in loads:
            row[f"measured {label[n]}"] = round(c.measured[n], 2)
            row[f"predicted {label[n]}"] = round(c.predicted.tokens_per_s[n], 2)
        rows.append(row)
    return {
        "bench": "placement",
        "model": {"layers": spec.layers, "gb": round(spec.shard_gb(spec.layers, True, True, 0), 3)},
        "fleet": [
            {
                "id": d.id,
                "cpus": d.spec.cpus,
                "memory_gb": d.spec.memory_gb,
                "gflops": round(d.gflops, 1),
                "bandwidth_gbps": round(d.bandwidth_gbps, 1),
            }
            for d in fleet.values()
        ],
        "candidates_run": len(placed),
        "feasible_splits": total,
        "sampled": len(placed) < total,
        "dwps": {"devices": list(dwps.devices), "counts": list(dwps.counts)},
        "dwps_over_best": {label[n]: round(dwps.measured[n] / best[n], 3) for n in loads},
        "dwps_over_exo": (
            {label[n]: round(dwps.measured[n] / exo.measured[n], 3) for n in loads} if exo else None
        ),
        "prediction_error_median": round(statistics.median(errors), 3),
        "prediction_error_median_corrected": round(statistics.median(after), 3) if after else None,
        # the prediction without the weight types' kernels (ENGINE_SHARE for all), beside it
        "prediction_error_median_sizes_only": round(statistics.median(sizes_only), 3),
        "placements": rows,
        "sweep": sweep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: a made one of --size-gb)")
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument(
        "--fleet",
        type=Path,
        help="a fleet file whose workers are the devices (default: deploy/fleets/home.yaml)",
    )
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--sweep", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 2, 5, 20]
    )
    parser.add_argument(
        "--named-only",
        action="store_true",
        help="run DWPS's, exo's and llama.cpp's placements only (no sample of the others)",
    )
    parser.add_argument("--json", action="store_true")
    add_results_option(parser)
    args = parser.parse_args()
    if why := unavailable():
        sys.exit(f"placement bench: {why}")
    if not (BINARIES / "llama-server").exists():
        sys.exit("placement bench: llama.cpp not built (make llama)")
    fleet_file = read_fleet_file(args.fleet or DEFAULT_FLEET)
    specs = load_fleet({"workers": fleet_file.get("workers", [])}).workers
    if not specs:
        sys.exit("placement bench: the fleet file lists no workers")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="placement-bench-") as tmp:
        gguf = args.model
        if gguf is None:
            sys.path.insert(0, str(REPO))
            from tests.made_models import make_gguf

            gguf = make_gguf(Path(tmp) / "made.gguf", "llama", "Q8_0", layers=16,
                             target_bytes=int(args.size_gb * 1e9))  # fmt: skip
        result = asyncio.run(run(args, specs, gguf))
    title = "Placements measured on a fleet the kernel holds"
    finish(args, result, started, "placement", title, "placements")


def finish(
    args: argparse.Namespace,
    result: dict[str, object],
    started: float,
    name: str,
    title: str,
    rows_key: str,
) -> None:
    """The run's time and command added to ``result``, its report written (the table of its
    rows, the list under ``rows_key``, then the other figures), and it printed."""
    result["seconds"] = round(time.monotonic() - started, 1)
    result["command"] = " ".join(["python", *sys.argv])
    rows: list[dict[str, object]] = result[rows_key]  # type: ignore[assignment]
    figures = {k: v for k, v in result.items() if k != rows_key}
    write_report(args.results, name, title, table(rows) + "\n\n" + table(figures))
    print(json.dumps(result, indent=2) if args.json else table(rows))


if __name__ == "__main__":
    main()
