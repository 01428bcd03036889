"""A batch outlives what runs it: the gateway killed (SIGKILL) mid-batch is started again by
`tessera up` and goes on with the requests not yet answered; the whole cluster stopped
mid-batch and started again on its home finishes it too; so does a batch whose only worker
is killed (SIGKILL) while it serves the batch's requests, and one whose Celery batch worker
is killed (SIGKILL) while it runs them. Every ``custom_id`` is answered
exactly once, with the greedy text the request gets alone."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Any

import httpx
import openai
import pytest

from libs.runtime.proc_tree import unit_pid
from tests.e2e.cluster import NEEDS_LLAMA, RunningCluster
from tests.e2e.test_batches import QUESTIONS, ended, jsonl, request, rows

pytestmark = [
    pytest.mark.timeout(900),
    NEEDS_LLAMA,
]
REQUESTS = 12


def answered(api: openai.OpenAI, batch_id: str, at_least: int) -> None:
    """Once ``at_least`` requests are answered, and the batch is still running."""
    deadline = time.monotonic() + 180
    while True:
        counts = api.batches.retrieve(batch_id).request_counts
        if counts is not None and counts.completed >= at_least:
            assert counts.completed < REQUESTS, "the batch ended before it was interrupted"
            return
        assert time.monotonic() < deadline, f"fewer than {at_least} answered in 180 s"
        time.sleep(0.2)


def texts(out: list[dict[str, Any]]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in out}


def test_a_batch_goes_on_after_the_gateway_is_killed_the_cluster_restarts_or_a_worker_dies() -> (
    None
):
    cluster = RunningCluster("--workers", "1")
    try:
        cluster.wait_for("ready:", 300)
        api = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="-", max_retries=8)
        asked = {f"r-{i}": request(QUESTIONS[i % len(QUESTIONS)], 16) for i in range(REQUESTS)}
        file = api.files.create(file=("in.jsonl", jsonl(asked)), purpose="batch")
        first = api.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        answered(api, first.id, 2)
        os.kill(unit_pid(cluster.process.pid, "gateway"), signal.SIGKILL)
        cluster.wait_for("gateway back after", 60)
        done = ended(api, first.id)
        assert done.status == "completed", done
        out = rows(api, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(asked)  # each exactly once
        alone = {
            cid: api.chat.completions.create(**body).choices[0].message.content
            for cid, body in asked.items()
        }
        assert texts(out) == alone

        second = api.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        answered(api, second.id, 2)
        cluster.stop()  # the whole cluster, mid-batch
        cluster = RunningCluster("--workers", "1", home=cluster.home)
        cluster.wait_for("ready:", 300)
        api = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="-", max_retries=8)
        done = ended(api, second.id)
        assert done.status == "completed", done
        out = rows(api, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(asked)
        assert texts(out) == alone
        assert json.loads(api.files.content(file.id).text.splitlines()[0])["custom_id"] == "r-0"

        # The worker serving the batch's requests, then the Celery worker running them, each
        # killed mid-request and started again: nothing lost, nothing answered twice.
        for unit, name in (("worker-0", "worker-0"), ("batch.worker", "batch-worker")):
            batch = api.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"
            )
            answered(api, batch.id, 2)
            os.kill(unit_pid(cluster.process.pid, unit), signal.SIGKILL)
            cluster.wait_for(f"{name} back after", 60)
            done = ended(api, batch.id)
            assert done.status == "completed", (done, rows(api, done.error_file_id))
            out = rows(api, done.output_file_id)
            assert sorted(r["custom_id"] for r in out) == sorted(asked)
            assert texts(out) == alone
        metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        again = re.findall(
            r'tessera_gateway_batch_requests_sent_again\{why="(worker_lost|not_taken)"\} (\S+)',
            metrics,
        )
        assert sum(float(count) for _, count in again) >= 1, again  # what the kill cut short
    finally:
        cluster.stop()
