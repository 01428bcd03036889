"""A split whose RPC server lends two devices, as a GPU host's does (its CPU for the shard's
first layers, its GPU for the last: ``RpcServer(gpu=True)`` runs it with ``-d CPU,CUDA0``):
the head's flags (``gpu_command``) name both and give each its layers, and the greedy text is
the whole model's.

No GPU here: the RPC server lends its CPU twice (``-d CPU,CPU``), standing in for CPU and
CUDA0, so the device names, the order and the layer counts are checked; whether CUDA serves
its part is for ``bench/gpu_check.py``'s ``gpu_rpc_worker_split`` on a GPU machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from libs.contracts import shard_ring
from libs.runtime.procs import free_port, wait_for_port
from services.worker.rpc.server import llama_env
from services.worker.served.llama_server import gpu_command, layer_split
from services.worker.settings import WorkerSettings
from tests.made_models import llama_server, make_gguf

BINARIES = WorkerSettings().llama_bin
pytestmark = pytest.mark.skipif(
    not (BINARIES / ".installed").exists(), reason="no llama.cpp build: `make llama`"
)
LAYERS, PROMPT, TOKENS = 6, "The quick brown fox", 16


def test_a_gpu_hosts_two_devices_take_the_layers_the_placement_gave_each(tmp_path: Path) -> None:
    gguf = make_gguf(tmp_path / "m.gguf", "llama", "F16", layers=LAYERS, hidden=128)
    with llama_server(gguf, threads=1) as whole:
        expected = whole.completion(PROMPT, TOKENS)["content"]
    port = free_port()
    rpc = subprocess.Popen(
        [str(BINARIES / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-d", "CPU,CPU"],
        env=llama_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port("127.0.0.1", port, 30, rpc)
        address = f"127.0.0.1:{port}"
        # Layers 0..1 on the head's CPU; 2..5 and the output on the RPC host, of which the
        # output and layers 4..5 on its second device (the GPU's place).
        spans = [("head", 0, 2), ("gpu-host", 2, LAYERS)]
        ends = ("127.0.0.1:1", address)  # the head's own: not used
        head, lent = shard_ring("load", "d", "m", spans, 1, 0.0, None, ends, gpu=[None, 3])
        assert (head.gpu_layers, lent.gpu_layers) == (0, 3)
        offload = gpu_command(head, *layer_split(head, LAYERS))
        flags = dict(zip(offload[::2], offload[1::2], strict=True))
        assert flags == {"--device": "RPC0,RPC1", "-ngl": "5", "-ts": "2,3"}
        with llama_server(gguf, threads=1, rpc=address, offload=offload) as split:
            assert split.completion(PROMPT, TOKENS)["content"] == expected
    finally:
        rpc.kill()
        rpc.wait()
