"""How a placement becomes llama.cpp's split: the head keeps its layers on its own CPU, the other
shards' layers go to their devices' RPC servers in route order (hand-checked layer counts)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from gguf import GGUFReader

from libs.contracts import shard_ring
from libs.core.catalogue import GB, card_spec
from libs.models.shipped import gguf_path, shipped_card
from services.worker.rpc.server import SPIN_COUNT
from services.worker.served.llama_server import LlamaServer, gpu_layers, layer_split

ENDPOINTS = ("10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052")


def ring(spans: list[tuple[int, int]], endpoints: tuple[str, ...] = ENDPOINTS):  # type: ignore[no-untyped-def]
    shards = [(f"d{i}", start, end) for i, (start, end) in enumerate(spans)]
    return shard_ring("load", "dep", "smollm2-135m-instruct", shards, 1, 0.0, None, endpoints)


def test_the_head_keeps_its_layers_and_offloads_the_rest_in_route_order() -> None:
    tasks = ring([(0, 12), (12, 21), (21, 30)])
    # layers 12..20 to d1, 21..29 and the output layer to d2: 19 of llama.cpp's 31 offloaded
    assert layer_split(tasks[0], 30) == (19, [9, 10])
    server = LlamaServer(Path("/bin"), Path("m.gguf"), tasks[0], 30, threads=2)
    command, _ = server.command()
    flags = dict(itertools.pairwise(command))
    assert flags["--rpc"] == "10.0.0.2:50052,10.0.0.3:50052"  # not the head's own
    assert flags["-ngl"] == "19" and flags["-ts"] == "9,10"


def test_llama_cpp_threads_stop_spinning_soon_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libgomp's default spin (300,000) keeps a split's idle stage busy on the cores the working
    stage needs; the servers get a short one, and an operator's own setting wins."""
    [task] = ring([(0, 30)], ENDPOINTS[:1])
    server = LlamaServer(Path("/bin"), Path("m.gguf"), task, 30, threads=2)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert server.command()[1]["GOMP_SPINCOUNT"] == SPIN_COUNT == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert server.command()[1]["GOMP_SPINCOUNT"] == "300000"


def test_a_whole_model_offloads_nothing() -> None:
    [task] = ring([(0, 30)], ENDPOINTS[:1])
    assert layer_split(task, 30) == (0, [])
    command, _ = LlamaServer(Path("/bin"), Path("m.gguf"), task, 30, threads=1).command()
    assert "--rpc" not in command and command[command.index("-ngl") + 1] == "0"


def test_only_a_first_shard_covering_every_layer_runs_the_server() -> None:
    tasks = ring([(0, 12), (12, 30)], ENDPOINTS[:2])
    with pytest.raises(ValueError, match="first shard"):
        layer_split(tasks[1], 30)
    with pytest.raises(ValueError, match=r"not 0\.\.32"):
        layer_split(tasks[0], 32)


def test_a_task_lists_one_endpoint_and_one_span_per_shard() -> None:
    with pytest.raises(ValueError, match="endpoints must list"):
        ring([(0, 12), (12, 30)], ENDPOINTS)
    tasks = ring([(0, 12), (12, 30)], ())
    assert tasks[1].spans == ((0, 12), (12, 30)) and tasks[1].endpoints == ()


def test_the_gguf_sizes_the_scheduler_counts_are_the_shipped_files() -> None:
    """Bytes of SmolLM2's layers and embeddings as the placement counts them are those of the
    GGUF's tensor table."""
    reader = GGUFReader(gguf_path())
    layer = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.0."))
    [embedding] = [t for t in reader.tensors if t.name == "token_embd.weight"]
    served = card_spec(shipped_card(), "llamacpp", slots=8)
    assert served.params_per_layer * served.bytes_per_param == pytest.approx(layer)
    assert served.embedding_params * served.embedding_bytes == pytest.approx(embedding.n_bytes)
    # A 1,024-token context: 8 slots' f16 KV cache per layer (3 KV heads of 64).
    assert served.layer_gb(1024) * GB == pytest.approx(layer + 8 * 1024 * 2 * 3 * 64 * 2)


def test_a_whole_model_goes_to_a_gpu_as_far_as_its_free_memory_holds(tmp_path: Path) -> None:
    """With a CUDA build and a GPU (its free memory given: no GPU here, the number stands in
    for NVML's reading), a whole model's layers go to the GPU, all where they fit 80 % of it,
    else as many as do, the rest on the CPU; without, the GPU is hidden from llama.cpp."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 31_000)  # 31 of llama.cpp's layers (30 and the output): 1,000 each
    (task,) = ring([(0, 30)], ENDPOINTS[:1])
    assert gpu_layers(30, 31_000, 10**9) == 31 and gpu_layers(30, 31_000, 20_000) == 16
    for free, layers in ((10**9, "31"), (20_000, "16")):
        server = LlamaServer(Path("/bin"), gguf, task, 30, threads=2, gpu_free_bytes=free)
        command, env = server.command()
        assert dict(itertools.pairwise(command))["-ngl"] == layers and "--device" not in command
        assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] != ""
    for free in (0, 500):  # no GPU, or too little for one layer
        command, env = LlamaServer(
            Path("/bin"), gguf, task, 30, threads=2, gpu_free_bytes=free
        ).command()
        assert command[-4:] == ["-ngl", "0", "--device", "none"]
        assert env["CUDA_VISIBLE_DEVICES"] == ""
