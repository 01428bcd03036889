"""A Hugging Face folder on vLLM, as a user brings one: a small random-weight llama written by
``transformers`` offline (``make_hf_folder``), added by path with `tessera models add DIR` to a
`tessera up` whose one worker is vLLM's (the CPU build here), deployed and asked through the
gateway, which has no tokenizer for it (vLLM's own tokenizes the prompt). Its greedy text equals
vLLM's own server's on the same folder, started with the flags the worker gives it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.worker.served.vllm_server import VllmServer
from services.worker.served.vllm_worker import vllm_runs_eager
from services.worker.settings import WorkerSettings
from tests.e2e.cluster import RunningCluster
from tests.made_models import make_hf_folder

SETTINGS = WorkerSettings()
pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        not SETTINGS.vllm_python.exists(),
        reason=f"no vLLM virtualenv at {SETTINGS.vllm_python}: `make vllm` builds it",
    ),
]
NAME = "tiny-hf"
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    running = RunningCluster(
        "--workers", "0", "--vllm-workers", "1", "--deploy", "none",
        env={"OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    running.wait_for("ready:", 300)
    yield running
    running.stop()


async def own_server_texts(folder: Path) -> list[str]:
    """vLLM's own OpenAI server on ``folder`` (the worker's flags: ``VllmServer``'s command),
    each prompt's greedy text."""
    server = VllmServer(
        SETTINGS.vllm_python, folder, NAME,
        dtype=SETTINGS.vllm_dtype, kv_cache_gb=SETTINGS.vllm_kv_cache_gb,
        eager=vllm_runs_eager(SETTINGS.vllm_eager, SETTINGS.vllm_python),
        max_model_len=SETTINGS.vllm_context,
    )  # fmt: skip
    await server.start(600)
    try:
        assert server.http is not None
        texts = []
        for prompt in PROMPTS:
            body = {"model": NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            answer = await server.http.post("/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            texts.append(answer.json()["choices"][0]["text"])
        return texts
    finally:
        await server.stop()


def test_a_folder_added_by_path_serves_with_vllms_own_greedy_text(
    cluster: RunningCluster, tmp_path: Path
) -> None:
    folder = make_hf_folder(tmp_path / "tiny-llama")
    expected = asyncio.run(own_server_texts(folder))
    assert all(expected) and len(set(expected)) == len(PROMPTS), expected  # text, per prompt
    code, out = cluster.tessera("preview", str(folder))  # before it is added: read here
    assert code == 0 and "vllm-0" in out and "device(s): ~" in out, out
    code, out = cluster.tessera("models", "add", str(folder), "--name", NAME)
    assert code == 0 and f"added {NAME}: LlamaForCausalLM, 2 layers" in out, out
    assert "served on this host" in out, out
    code, out = cluster.tessera("deploy", NAME, "--id", "tiny", "--timeout", "600", timeout_s=660)
    assert code == 0 and "tiny serving on vllm-0" in out, out
    for prompt, text in zip(PROMPTS, expected, strict=True):
        body = {"model": NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        answer = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text, prompt
    # A second model beside it on the same worker (a vLLM server each, as its memory holds):
    # both answer, the first as before.
    code, out = cluster.tessera(
        "deploy", "smollm2-135m-instruct", "--id", "smol", "--timeout", "600", timeout_s=660
    )
    assert code == 0 and "smol serving on vllm-0" in out, out
    body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}
    answer = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected[0]
