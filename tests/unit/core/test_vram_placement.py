"""A device whose engine offloads layers to a GPU: the placement counts its VRAM apart from its
host memory, for a whole model and for any shard of a split (the head's server and a GPU
host's RPC server both serve from its GPU), and says what each shard holds where."""

from __future__ import annotations

import dataclasses

import pytest

from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.partition import gpu_part, plan, previews
from services.scheduler.fit import fleet_too_small
from tests.builders import make_device

#: 32 layers of 0.45 GB at a 4,096-token context, 1.05 GB of output layer: 16.85 GB whole.
LLAMA8 = HYPOTHETICAL_MODELS["llama-3.1-8b-instruct"]
CONTEXT = 4096


def gpu_host(host_gb: float = 8.0, vram_gb: float = 12.0, name: str = "gpu") -> object:
    return make_device(name, memory_total_gb=32.0, memory_free_gb=host_gb, vram_free_gb=vram_gb)


def test_a_whole_model_larger_than_host_memory_fits_host_memory_and_vram_together() -> None:
    whole = LLAMA8.shard_gb(LLAMA8.layers, True, True, CONTEXT)
    option = plan(LLAMA8, [gpu_host()], CONTEXT)
    assert option.feasible, option.reason
    (shard,) = option.shards
    # The output layer and the last 24 layers (1.05 + 24 × 0.45 GB) in the 12 GB of VRAM, the
    # rest (8 layers, the embeddings, the runtime) in host memory: each within its own room.
    assert shard.gpu_layers == 25
    assert shard.vram_gb == pytest.approx(1.0507 + 24 * 0.4530, abs=1e-3)
    assert shard.vram_gb <= 12.0 and shard.memory_gb <= 8.0
    assert shard.memory_gb + shard.vram_gb == pytest.approx(whole, abs=1e-3)
    # The same host without a GPU its engine uses cannot hold it.
    cpu_only = plan(LLAMA8, [gpu_host(vram_gb=0.0)], CONTEXT)
    assert not cpu_only.feasible and "memory" in (cpu_only.reason or "")


def test_a_model_that_fits_the_vram_is_held_there_entirely() -> None:
    # Host memory holds the embeddings (1.05 GB) and the runtime (0.25 GB), no layer.
    (shard,) = plan(LLAMA8, [gpu_host(host_gb=1.5, vram_gb=40.0)], CONTEXT).shards
    assert shard.gpu_layers == LLAMA8.layers + 1  # llama.cpp's -ngl: every layer and the output
    assert shard.vram_gb == pytest.approx(1.0507 + 32 * 0.4530, abs=1e-3)
    assert shard.memory_gb == pytest.approx(LLAMA8.embedding_params * 2 / 1e9 + 0.25, abs=1e-3)


def test_every_shard_on_a_gpu_host_counts_its_vram() -> None:
    """A split's head offloads its own last layers to its GPU, and a GPU host's RPC server
    serves its shard's last layers (the last shard's output layer first) from its GPU: either
    way the shard holds more than its host memory could."""
    cpu = make_device("cpu", memory_total_gb=32.0, memory_free_gb=10.0)
    head = plan(LLAMA8, [gpu_host(host_gb=2.0, vram_gb=6.0), cpu], CONTEXT)
    assert head.feasible, head.reason
    first, second = head.shards
    assert first.gpu_layers > 0 and first.vram_gb <= 6.0 and first.memory_gb <= 2.0
    assert second.gpu_layers == 0 and second.vram_gb == 0.0
    assert first.layers > 2.0 / LLAMA8.layer_gb(CONTEXT)
    behind = plan(LLAMA8, [cpu, gpu_host(host_gb=2.0, vram_gb=6.0)], CONTEXT)
    assert behind.feasible, behind.reason
    front, last = behind.shards
    # The last shard: the output layer (1.05 GB) and then its last layers in the 6 GB.
    assert last.gpu_layers == 1 + int((6.0 - 1.0507) / LLAMA8.layer_gb(CONTEXT))
    assert last.vram_gb <= 6.0 and last.memory_gb <= 2.0 and front.gpu_layers == 0
    # Without its VRAM counted, 10 + 2 GB cannot hold 16.85 GB.
    cpu_only = plan(LLAMA8, [cpu, gpu_host(host_gb=2.0, vram_gb=0.0)], CONTEXT)
    assert not cpu_only.feasible and "memory" in (cpu_only.reason or "")


def test_previews_put_the_gpu_host_first_and_serve_the_model_whole_there() -> None:
    cpus = [make_device(f"cpu-{i}", memory_total_gb=32.0, memory_free_gb=9.0) for i in range(2)]
    options = previews(LLAMA8, [*cpus, gpu_host()], CONTEXT)
    assert options[0].devices == ("gpu",) and options[0].feasible


def test_a_model_larger_than_the_gpu_and_host_refused_saying_so() -> None:
    reason = plan(LLAMA8, [gpu_host(host_gb=2.0, vram_gb=6.0)], CONTEXT).reason or ""
    assert "VRAM" in reason and "16.85" in reason
    told = fleet_too_small(LLAMA8, [gpu_host(host_gb=2.0, vram_gb=6.0)], CONTEXT) or ""
    assert "6.00 GB of it a GPU's" in told and "make join" in told
    assert fleet_too_small(LLAMA8, [gpu_host()], CONTEXT) is None


def test_gpu_part_counts_layers_from_the_last_and_nothing_without_vram() -> None:
    assert gpu_part(LLAMA8, 0, 10, False, CONTEXT, 0.0) == (0, 0.0)
    count, used = gpu_part(LLAMA8, 4, 14, False, CONTEXT, 1.0)  # two layers of 0.45 GB
    assert count == 2 and used == pytest.approx(2 * LLAMA8.layer_gb(CONTEXT))
    # The output layer goes first (llama.cpp offloads from the end): with less VRAM than it
    # takes, nothing is offloaded.
    assert gpu_part(LLAMA8, 0, LLAMA8.layers, True, CONTEXT, 1.0) == (0, 0.0)


def test_a_tied_models_output_on_the_gpu_is_a_copy_its_host_memory_keeps() -> None:
    """A tied model's output layer is its embedding matrix: offloaded, the GPU holds a copy and
    host memory keeps the embeddings the first layer reads."""
    tied = dataclasses.replace(LLAMA8, tied=True, head_params=0.0)
    (shard,) = plan(tied, [gpu_host(host_gb=1.5, vram_gb=40.0)], CONTEXT).shards
    embeddings = tied.embedding_params * 2 / 1e9
    assert shard.gpu_layers == tied.layers + 1
    assert shard.memory_gb == pytest.approx(embeddings + 0.25, abs=1e-3)
    assert shard.vram_gb == pytest.approx(embeddings + 32 * 0.4530, abs=1e-3)


def test_the_preview_table_shows_vram_only_where_a_shard_holds_some() -> None:
    from rich.console import Console

    from libs.cli.scheduling import shards_table

    def shown(shards: list[dict[str, object]]) -> str:
        console = Console(width=120, record=True)
        console.print(shards_table("t", shards))
        return console.export_text()

    cpu = {"shard_index": 0, "device_id": "a", "layer_start": 0, "layer_end": 30, "memory_gb": 0.4}
    assert "VRAM" not in shown([cpu])
    gpu = {**cpu, "memory_gb": 0.25, "vram_gb": 0.14, "gpu_layers": 31}
    assert "VRAM" in shown([gpu]) and "0.14 (31 layers)" in shown([gpu])


def test_a_worker_counts_in_host_memory_what_the_placement_left_there() -> None:
    """The worker's own check of its memory (``held_gb``) leaves out the layers the placement
    put in the VRAM: what ``gpu_held_gb`` gives for those layers is what ``gpu_part`` counted."""
    from libs.core.partition import gpu_held_gb

    for start, end, output in ((0, 32, True), (10, 20, False), (20, 32, True)):
        count, used = gpu_part(LLAMA8, start, end, output, CONTEXT, 5.0)
        assert count > 0
        assert gpu_held_gb(LLAMA8, start, end, output, CONTEXT, count) == pytest.approx(used)
    assert gpu_held_gb(LLAMA8, 0, 32, True, CONTEXT, 0) == 0.0
