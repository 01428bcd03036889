"""A model larger than any one device: a generated ~1 GB GGUF (llama, Q8_0, untied) planned by
the scheduler's own partition over devices of 0.5 GB each, run as llama.cpp runs a placement
(the head's llama-server and one RPC server per other device), serves; and each RPC server
grows by the bytes the placement counts for its shard, within 10 %."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from libs.contracts import DeviceClass, Sampling, shard_ring
from libs.core.catalogue import GB, card_spec
from libs.core.partition import plan
from libs.models.gguf_info import read_card
from services.scheduler.replicas import ENGINE_SLOTS
from services.worker.rpc.server import RpcServer
from services.worker.served.llama_server import LlamaServer
from services.worker.settings import WorkerSettings
from tests.builders import make_device
from tests.made_models import make_gguf

BINARIES = WorkerSettings().llama_bin
pytestmark = pytest.mark.skipif(
    not (BINARIES / ".installed").exists(), reason="no llama.cpp build: `make llama`"
)
CAP_GB = 0.5
CONTEXT = 512


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


async def test_a_model_larger_than_any_device_is_split_and_each_part_is_counted(
    tmp_path: Path,
) -> None:
    path = make_gguf(tmp_path / "big.gguf", "llama", "Q8_0", layers=16, tied=False,
                     target_bytes=1_000_000_000)  # fmt: skip
    card = read_card(path, name="big")
    spec = card_spec(card, "llamacpp", ENGINE_SLOTS["llamacpp"])
    assert spec.shard_gb(card.layers, True, True, CONTEXT) > 2 * CAP_GB  # no device holds it
    preview = None
    for count in range(2, 9):  # the fewest 0.5 GB devices that hold it
        devices = [
            make_device(f"d{i}", DeviceClass.LAPTOP, memory_free_gb=CAP_GB) for i in range(count)
        ]
        preview = plan(spec, devices, CONTEXT)
        if preview.feasible:
            break
    assert preview is not None and preview.feasible, preview
    assert preview.shards and all(s.memory_gb <= CAP_GB for s in preview.shards)
    rpcs = [RpcServer(BINARIES, "127.0.0.1", threads=1) for _ in preview.shards[1:]]
    for rpc in rpcs:
        await rpc.start()
    before = [resident_bytes(rpc.proc.pid) for rpc in rpcs if rpc.proc is not None]
    shards = [(s.device_id, s.layer_start, s.layer_end) for s in preview.shards]
    endpoints = ("127.0.0.1:1", *(rpc.endpoint for rpc in rpcs))  # the head's own is not used
    tasks = shard_ring("load", "big", "big", shards, 1, 0.0, None, endpoints, CONTEXT, card)
    server = LlamaServer(BINARIES, path, tasks[0], card.layers, threads=1, context=CONTEXT)
    try:
        await server.start(180.0)
        pieces = [p async for p in server.complete(list(range(1, 9)), Sampling(max_tokens=8), 8)]
        assert pieces, "the split model served nothing"
        for rpc, grown_from, shard in zip(rpcs, before, preview.shards[1:], strict=True):
            assert rpc.proc is not None
            grown = resident_bytes(rpc.proc.pid) - grown_from
            last = shard.shard_index == len(preview.shards) - 1
            layers = shard.layers
            counted = (spec.shard_gb(layers, False, last, CONTEXT) - spec.runtime_overhead_gb) * GB
            print(f"{shard.device_id}: layers {layers}, grew {grown / GB:.3f} GB, "
                  f"counted {counted / GB:.3f} GB")  # fmt: skip
            assert abs(grown - counted) <= 0.1 * counted, (shard.device_id, grown, counted)
    finally:
        await server.stop()
        for rpc in rpcs:
            await rpc.stop()
