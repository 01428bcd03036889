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
from services.worker.served.llama_server import LlamaServer, layer_split

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


def test_the_layers_the_placement_put_on_the_gpu_go_there_and_no_others() -> None:
    """The placement's GPU layers (devices that announced their VRAM: a CUDA build on a GPU
    host) reach llama.cpp's flags: a whole model's as ``-ngl``; a split head's own last layers
    on its GPU, named first in the device order (RPC servers come first by default) and given
    its count first in ``--tensor-split``; a GPU host's RPC server lends two devices, its CPU
    for its shard's first layers and its GPU for the last. Without, the GPU is hidden and
    nothing but the RPC servers' layers is offloaded."""
    (whole,) = shard_ring("load", "dep", "m", [("d0", 0, 30)], 1, 0.0, gpu=[31])
    command, env = LlamaServer(Path("/bin"), Path("m.gguf"), whole, 30, threads=2).command()
    assert dict(itertools.pairwise(command))["-ngl"] == "31" and "--device" not in command
    assert env.get("CUDA_VISIBLE_DEVICES") != ""
    spans = [("d0", 0, 12), ("d1", 12, 21), ("d2", 21, 30)]
    head, *rest = shard_ring(
        "load", "dep", "m", spans, 1, 0.0, None, ENDPOINTS, gpu=[5, None, None]
    )
    assert [t.gpu_layers for t in rest] == [0, 0]
    command, env = LlamaServer(Path("/bin"), Path("m.gguf"), head, 30, threads=2).command()
    flags = dict(itertools.pairwise(command))
    assert flags["--device"] == "CUDA0,RPC0,RPC1" and flags["--rpc"] == ",".join(ENDPOINTS[1:])
    assert command.index("--rpc") < command.index("--device")  # named once registered
    # layers 7..11 on the GPU, 12..20 on d1, 21..29 and the output on d2: 24 of 31 offloaded
    assert flags["-ngl"] == "24" and flags["-ts"] == "5,9,10"
    assert env.get("CUDA_VISIBLE_DEVICES") != ""
    # A CPU head, d1 a GPU host holding 4 of its 9 layers on its GPU: its RPC server lends its
    # CPU (RPC1: layers 12..16) and its GPU (RPC2: 17..20); the head's own GPU stays hidden.
    head, lent, _ = shard_ring(
        "load", "dep", "m", spans, 1, 0.0, None, ENDPOINTS, gpu=[None, 4, None]
    )
    assert lent.gpu_layers == 4 and lent.gpu_spans == (None, 4, None)
    command, env = LlamaServer(Path("/bin"), Path("m.gguf"), head, 30, threads=2).command()
    flags = dict(itertools.pairwise(command))
    assert flags["--device"] == "RPC0,RPC1,RPC2" and flags["-ts"] == "5,4,10"
    assert flags["-ngl"] == "19" and env["CUDA_VISIBLE_DEVICES"] == ""
    for task in (ring([(0, 30)], ENDPOINTS[:1])[0], ring([(0, 12), (12, 30)], ENDPOINTS[:2])[0]):
        command, env = LlamaServer(Path("/bin"), Path("m.gguf"), task, 30, threads=2).command()
        assert "CUDA0" not in command and env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gpu_hosts_rpc_server_lends_its_cpu_then_its_gpu() -> None:
    """A device that announced its VRAM runs its RPC server on its CPU and its GPU, in that
    order (the head names them so); any other, on its CPU with the GPU hidden."""
    from services.worker.rpc.server import RpcServer

    binary = Path("/bin/ggml-rpc-server")
    command, env = RpcServer(Path("/bin"), "127.0.0.1", 50052, gpu=True).command(binary)
    assert dict(itertools.pairwise(command))["-d"] == "CPU,CUDA0"
    assert env.get("CUDA_VISIBLE_DEVICES") != ""
    command, env = RpcServer(Path("/bin"), "127.0.0.1", 50053).command(binary)
    assert "-d" not in command and env["CUDA_VISIBLE_DEVICES"] == ""
