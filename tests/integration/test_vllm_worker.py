"""The vLLM worker for real: a vLLM server (the CPU build, in .venv-vllm) serving SmolLM2 whole,
driven through the same shard tasks and NATS subjects as the torch workers."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NatsClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from libs.cluster.servers import NatsServer
from libs.contracts import GenerationRequest, Sampling
from libs.harness.workers import LocalWorkers, even_split, generate_direct, place, shard_tasks
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, prepare
from libs.runtime.bus import NatsBus
from services.gateway.core.deployed import Deployed, hand_placed
from services.gateway.core.generation import GenerationClient
from services.worker.settings import WorkerSettings

VLLM_PYTHON = WorkerSettings().vllm_python
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"no vLLM virtualenv at {VLLM_PYTHON}: `make vllm` builds it (`make test` does)",
    ),
]
DEVICE = "vw-a"
PROMPTS = ("What is the capital of France?", "Write a story about a fox.")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def worker(nats_server: NatsServer) -> Iterator[LocalWorkers]:
    env = {
        "TESSERA_WORKER_ENGINE": "vllm",
        "TESSERA_WORKER_VLLM_DTYPE": "float32",  # the reference below runs in float32 too
        "OMP_NUM_THREADS": "2",
    }
    with LocalWorkers(nats_server.url, [DEVICE], env=env) as running:
        yield running


def vllm_log(worker: LocalWorkers) -> Path:
    """The log file of the vLLM server the worker started (its "starting vllm" line names it)."""
    said = [line for line in worker.workers[DEVICE].lines if line.get("msg") == "starting vllm"]
    assert said, worker.workers[DEVICE].tail()
    return Path(said[-1]["log"])


def reference_tokens(ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(prepare(), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


async def test_vllm_serves_the_whole_model_resumes_and_refuses_layer_shards(
    worker: LocalWorkers, nc: NatsClient
) -> None:
    deployment = "dep-" + uuid.uuid4().hex[:8]
    tasks = shard_tasks(deployment, MODEL_NAME, (DEVICE,), [(0, 30)], epoch=1)
    (status,) = await place(nc, tasks, timeout_s=400)
    assert status.state == "loaded", status.reason
    # "loaded" means the engine has answered: vLLM's log holds a completion already (the
    # worker's one-token request), so the first request after it does not wait for vLLM's first
    # forward pass (tens of seconds when it was only up; a few tenths now: printed below).
    assert "POST /v1/completions" in vllm_log(worker).read_text(errors="replace")
    book = Deployed()
    book.hold(hand_placed(tasks))
    client = GenerationClient(NatsBus(nc), book)
    tokenizer = AutoTokenizer.from_pretrained(prepare())
    first_token_s: list[float] = []
    for text in PROMPTS:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
        want = reference_tokens(ids)
        chunks = []
        sent = time.monotonic()
        async for c in client.stream(
            deployment, uuid.uuid4().hex[:12], ids, Sampling(max_tokens=NEW_TOKENS)
        ):
            if not chunks:
                first_token_s.append(time.monotonic() - sent)
            chunks.append(c)
        got = [c.token_id for c in chunks if c.token_id is not None]
        assert got == want, text  # vLLM's greedy tokens are the whole model's
        assert [c.index for c in chunks if c.token_id is not None] == list(range(len(got)))
        final = chunks[-1]
        assert final.finish_reason == ("length" if len(want) == NEW_TOKENS else "stop")
        assert final.completion_tokens == len(want) and final.device_id == DEVICE
        assert "".join(c.text for c in chunks) == tokenizer.decode(want, skip_special_tokens=True)

        # The owner's re-run after a migration: the tokens already streamed come back as
        # generated_token_ids and the worker continues after them, numbering from there.
        half = len(want) // 2
        resumed = GenerationRequest(
            request_id=uuid.uuid4().hex[:12],
            deployment_id=deployment,
            epoch=1,
            prompt_token_ids=tuple(ids),
            generated_token_ids=tuple(want[:half]),
            sampling=Sampling(max_tokens=NEW_TOKENS),
            ts=time.time(),
        )
        rest = await generate_direct(nc, resumed, DEVICE)
        assert [c.token_id for c in rest if c.token_id is not None] == want[half:]
        assert rest[0].index == half and rest[-1].completion_tokens == len(want)

    print(f"first token after {first_token_s[0]:.2f} s, then {first_token_s[1:]}")

    # A layer shard is not vLLM's to serve: refused, with the reason.
    split = shard_tasks("dep-split", MODEL_NAME, (DEVICE, "vw-gone"), even_split(30, 2), epoch=1)
    (refused,) = await place(nc, split[:1], timeout_s=30)
    assert refused.state == "refused" and "whole models" in (refused.reason or "")
