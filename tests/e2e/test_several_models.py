"""Several models on the cluster `make up` starts (the shared cluster: two llama.cpp workers,
SmolLM2 serving as it starts), as Ollama and GPUStack serve them: a second model (a GGUF made
here, added by path) split in 2 over both workers and a third whole, beside SmolLM2. All three
answer at once, each with the greedy text llama.cpp's own server gives on the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.models.shipped import MODEL_NAME, gguf_path
from tests.e2e import shared
from tests.e2e.cluster import NEEDS_LLAMA, RunningCluster
from tests.made_models import llama_server, make_gguf

pytestmark = [
    pytest.mark.timeout(900),
    NEEDS_LLAMA,
]
KEY = shared.KEYS[2]
HEADERS = {"authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
NEW_TOKENS = 12


def get(cluster: RunningCluster, path: str) -> Any:
    answer = httpx.get(f"{cluster.base_url}{path}", headers=HEADERS, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def greedy(cluster: RunningCluster, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    answer = httpx.post(
        f"{cluster.base_url}/v1/completions", json=body, headers=HEADERS, timeout=120
    )
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["choices"][0]["text"]
    return text


def reference(path: Path) -> str:
    """llama.cpp's own server's greedy text on the whole file."""
    with llama_server(path) as server:
        text: str = server.completion(PROMPT, NEW_TOKENS)["content"]
    return text


def test_a_second_model_split_and_a_third_whole_serve_beside_smollm2(
    shared_cluster: RunningCluster, tmp_path: Path
) -> None:
    cluster = shared_cluster
    rows = get(cluster, "/v1/cluster/placements")
    first = next(r for r in rows if r["model"] == MODEL_NAME)
    assert first["phase"] == "serving", first
    workers = ["worker-0", "worker-1"]  # `tessera up`'s two CPU workers
    assert {a["device_id"] for a in first["assignments"]} <= set(workers), first
    files = {
        "second-e2e": make_gguf(tmp_path / "second.gguf", "qwen2", "Q8_0", layers=6, hidden=128),
        "third-e2e": make_gguf(tmp_path / "third.gguf", "llama", "F16", layers=4, hidden=128),
    }
    expected = {name: reference(path) for name, path in files.items()}
    expected[MODEL_NAME] = reference(gguf_path())
    try:
        for name, path in files.items():
            code, out = cluster.tessera("models", "add", str(path), "--name", name)
            assert code == 0, out
        devices = ",".join(workers)
        code, out = cluster.tessera(
            "deploy", "second-e2e", "--shards", "2", "--devices", devices, "--id", "two"
        )
        assert code == 0 and "two serving on" in out, out
        code, out = cluster.tessera("deploy", "third-e2e", "--shards", "1", "--id", "three")
        assert code == 0 and "three serving on" in out, out

        placed = {r["deployment_id"]: r for r in get(cluster, "/v1/cluster/placements")}
        assert {a["device_id"] for a in placed["two"]["assignments"]} == set(workers)
        assert len(placed["three"]["assignments"]) == 1
        assert placed[first["deployment_id"]]["phase"] == "serving"  # SmolLM2 serves on
        listed = {m["id"] for m in get(cluster, "/v1/models")["data"]}
        assert {MODEL_NAME, "second-e2e", "third-e2e"} <= listed
        for name, text in expected.items():
            assert greedy(cluster, name) == text, name
    finally:
        for deployment in ("two", "three"):
            httpx.delete(
                f"{cluster.base_url}/v1/cluster/placements/{deployment}",
                headers=HEADERS,
                timeout=60,
            )
        for name in files:
            cluster.tessera("models", "rm", name)
    assert greedy(cluster, MODEL_NAME) == expected[MODEL_NAME]  # and after the others left
