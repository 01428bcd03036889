"""OpenAI's Batch API on the cluster `make up` starts (the shared cluster), with the official
``openai`` client as a user's tools send it: a JSONL file of requests uploaded, a batch of it
created with a completion window, polled, its output read. Every ``custom_id`` is answered
once, with the greedy text the same request gets sent alone. A bad file is refused naming its
line, a window too short is declined at once with the reason, and nothing of either is
queued; a cancelled batch keeps what it answered. ``tessera jobs`` does the same from a
terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from libs.models.shipped import MODEL_NAME
from tests.e2e import shared
from tests.e2e.cluster import NEEDS_LLAMA, RunningCluster

pytestmark = [
    pytest.mark.timeout(600),
    NEEDS_LLAMA,
]
KEY = shared.KEYS[3]
QUESTIONS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "Name a city."]
TOKENS = 10


def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY, max_retries=0)


def request(question: str, tokens: int = TOKENS) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": tokens, "temperature": 0}


def jsonl(requests: dict[str, dict[str, Any]]) -> bytes:
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        for cid, body in requests.items()
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def ended(api: openai.OpenAI, batch_id: str, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"{batch_id} still {batch.status}: {batch.request_counts}")


def rows(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in api.files.content(file_id).text.splitlines() if x.strip()]


def test_a_batch_through_the_openai_client_answers_each_request_once_as_alone(
    shared_cluster: RunningCluster,
) -> None:
    api = client(shared_cluster)
    asked = {f"q-{i}": request(q) for i, q in enumerate(QUESTIONS)}
    uploaded = api.files.create(file=("questions.jsonl", jsonl(asked)), purpose="batch")
    assert uploaded.bytes == len(jsonl(asked))
    batch = api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="30m"
    )
    assert batch.status == "in_progress" and batch.request_counts.total == len(asked)
    assert "admitted" in str(batch.model_extra["decision"])  # type: ignore[index]
    done = ended(api, batch.id)
    assert done.status == "completed", done
    assert done.completed_at is not None and done.completed_at <= done.expires_at  # in its window
    assert done.request_counts.completed == len(asked) and done.request_counts.failed == 0
    assert done.error_file_id is None
    out = rows(api, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(asked)  # each once
    answers = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in out
    }
    assert all(r["response"]["status_code"] == 200 for r in out)
    alone = {
        cid: api.chat.completions.create(**body).choices[0].message.content
        for cid, body in asked.items()
    }
    assert answers == alone
    # The devices that answered (each answer names them in x-tessera-devices): the model's.
    said = api.chat.completions.with_raw_response.create(**asked["q-0"]).headers
    placements = httpx.get(
        f"{shared_cluster.base_url}/v1/cluster/placements",
        headers={"authorization": f"Bearer {KEY}"},
    ).json()
    serving = {a["device_id"] for p in placements for a in p["assignments"]}
    devices = set(done.model_extra["devices"])  # type: ignore[index]
    assert devices and devices <= serving, (devices, serving)
    assert set(said["x-tessera-devices"].split(",")) <= serving, said
    listed = [b.id for b in api.batches.list()]
    assert batch.id in listed


def test_bad_files_and_unmeetable_windows_are_refused_at_once_and_nothing_is_queued(
    shared_cluster: RunningCluster,
) -> None:
    api = client(shared_cluster)
    before = [b.id for b in api.batches.list(limit=100)]
    good = jsonl({"a": request("Hi."), "b": request("Hello.")})
    bad = good + b'{"custom_id": "c", "url": "/v1/chat/completions", "body": {"model": 1}}\n'
    cases = [
        (bad, "30m", "line 3: body.model"),
        (good + good, "30m", "line 3: custom_id 'a' is also on line 1"),
        (good.replace(MODEL_NAME.encode(), b"no-such-model"), "30m", "line 1: model"),
        (good, "a while", "completion_window"),
    ]
    for content, window, said in cases:
        uploaded = api.files.create(file=("in.jsonl", content), purpose="batch")
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as refused:
            api.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                completion_window=window,  # type: ignore[arg-type]
            )  # fmt: skip
        assert said in str(refused.value), refused.value
    # Far more tokens than a few seconds hold: declined with what it needs and what is free.
    many = jsonl({f"n-{i}": request("Write a long story.", 4000) for i in range(40)})
    uploaded = api.files.create(file=("long.jsonl", many), purpose="batch")
    with pytest.raises(openai.BadRequestError) as declined:
        api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions",
            completion_window="20s",  # type: ignore[arg-type]
        )  # fmt: skip
    assert "batch declined (edf): needs about" in str(declined.value), declined.value
    assert declined.value.code == "deadline_unmeetable"
    assert [b.id for b in api.batches.list(limit=100)] == before  # nothing queued
    with pytest.raises(openai.BadRequestError, match="UTF-8"):
        api.files.create(file=("bin.jsonl", b"\xff\xfe\x00"), purpose="batch")
    with pytest.raises(openai.APIStatusError) as too_big:
        api.files.create(file=("big.jsonl", b"x" * (shared.FILES_MAX_BYTES + 1)), purpose="batch")
    assert too_big.value.status_code == 413


def test_a_cancelled_batch_keeps_what_it_answered_and_names_the_rest(
    shared_cluster: RunningCluster, tmp_path: Path
) -> None:
    api = client(shared_cluster)
    asked = {f"c-{i}": request(QUESTIONS[i % len(QUESTIONS)], 24) for i in range(30)}
    uploaded = api.files.create(file=("many.jsonl", jsonl(asked)), purpose="batch")
    batch = api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    deadline = time.monotonic() + 120
    while api.batches.retrieve(batch.id).request_counts.completed < 1:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no request answered in 120 s"
        time.sleep(0.2)
    code, said = shared_cluster.tessera("jobs", "cancel", batch.id, "--api-key", KEY)
    assert code == 0 and batch.id in said, said
    done = ended(api, batch.id)
    assert done.status == "cancelled", done
    answered, cancelled = rows(api, done.output_file_id), rows(api, done.error_file_id)
    assert answered and cancelled, done
    assert sorted(r["custom_id"] for r in answered + cancelled) == sorted(asked)
    assert {r["error"]["code"] for r in cancelled} == {"batch_cancelled"}
    counts = done.request_counts
    assert (counts.completed, counts.failed) == (len(answered), len(cancelled))  # type: ignore[union-attr]


def test_tessera_jobs_submits_a_file_shows_progress_and_prints_the_results(
    shared_cluster: RunningCluster, tmp_path: Path
) -> None:
    questions = tmp_path / "questions.jsonl"
    lines = [{"custom_id": f"j-{i}", "body": {"messages": request(q)["messages"], "max_tokens": 6}}
             for i, q in enumerate(QUESTIONS[:3])]  # fmt: skip
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    key = ("--api-key", KEY)
    code, said = shared_cluster.tessera(
        "jobs", "submit", str(questions), "--model", MODEL_NAME, "--within", "10m", "--wait", *key
    )
    assert (
        code == 0
        and "admitted (edf): planned to end in" in said
        and "completed: 3 answered" in said
    ), said
    [batch_id] = re.findall(r"batch-[0-9a-f]{24}", said)[:1]
    code, listed = shared_cluster.tessera("jobs", "list", *key)
    assert code == 0 and batch_id in listed and "completed" in listed, listed
    env = {**os.environ, "TESSERA_RUN_FILE": str(shared_cluster.run_file)}
    output = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", "jobs", "results", batch_id, *key],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    got = [json.loads(x) for x in output.splitlines()]
    assert [r["custom_id"] for r in got] == ["j-0", "j-1", "j-2"]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in got)


def test_tessera_jobs_submit_train_trains_on_the_batch_worker_and_keeps_the_weights(
    shared_cluster: RunningCluster, tmp_path: Path
) -> None:
    """The second job kind: training runs, admitted by the same policy, trained by the batch
    worker ``tessera up`` started, their checkpoints in the cluster's home."""
    from services.batch.training import train

    key = ("--api-key", KEY)
    code, said = shared_cluster.tessera(
        "jobs", "submit", "--train", "--runs", "2", "--steps", "600", "--every", "100",
        "--within", "10m", "--wait", *key,
    )  # fmt: skip
    assert code == 0 and "training steps" in said and "completed: 2 answered" in said, said
    [batch_id] = re.findall(r"batch-[0-9a-f]{24}", said)[:1]
    env = {**os.environ, "TESSERA_RUN_FILE": str(shared_cluster.run_file)}
    output = subprocess.run(
        [sys.executable, "-m", "libs.cli.main", "jobs", "results", batch_id, *key],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    runs = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, output.splitlines())}
    assert sorted(runs) == ["run-0", "run-1"]
    for seed in (0, 1):
        run = runs[f"run-{seed}"]
        alone = train(f"alone-{seed}", 600, tmp_path, every=100, seed=seed)
        assert run["steps"] == 600 and run["weights_sha256"] == alone.weights_sha256, run
        checkpoint = Path(run["checkpoint"])
        assert checkpoint.parent == shared_cluster.home / "training" and checkpoint.exists()


def test_anthropics_message_batches_run_on_the_same_core(shared_cluster: RunningCluster) -> None:
    """Anthropic's client: requests inline, results in its shape, each as the request alone."""
    import anthropic

    api = anthropic.Anthropic(base_url=shared_cluster.base_url, api_key=KEY, max_retries=0)

    def params(question: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": question}]
        return {"model": MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "messages": messages}

    asked = {f"m-{i}": params(q) for i, q in enumerate(QUESTIONS[:3])}
    batch = api.messages.batches.create(
        requests=[{"custom_id": cid, "params": p} for cid, p in asked.items()]  # type: ignore[misc]
    )
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 3
    deadline = time.monotonic() + 300
    while (batch := api.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.request_counts.succeeded == 3 and batch.results_url
    results = {r.custom_id: r.result for r in api.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(asked)
    texts = {cid: r.message.content[0].text for cid, r in results.items()}  # type: ignore[union-attr]
    alone = {  # this SDK leaves sampling to the server: temperature goes as an extra field
        cid: api.messages.create(  # type: ignore[call-overload]
            **{k: v for k, v in p.items() if k != "temperature"}, extra_body={"temperature": 0}
        )
        .content[0]
        .text
        for cid, p in asked.items()
    }
    assert texts == alone
    # A request its endpoint would refuse: the whole batch is refused, naming its index.
    bad = [{"custom_id": "ok", "params": params("Hi")},
           {"custom_id": "bad", "params": {**params("Hi"), "max_tokens": 0}}]  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match=r"requests\.1: body\.max_tokens"):
        api.messages.batches.create(requests=bad)  # type: ignore[arg-type]
