"""Every NATS consumer of the running cluster, flooded with malformed messages: nothing
crashes, every rejection is counted by channel and reason, and the cluster still serves."""

from __future__ import annotations

import asyncio
import collections
import re
import time

import openai
import pytest

from libs.cluster import runfile
from libs.harness.fuzz import flood, tally
from libs.runtime.nats_client import close_nats, connect_nats
from tests.builders import sample_messages
from tests.e2e import shared
from tests.e2e.cluster import RunningCluster

MODEL = "smollm2-135m-instruct"
COUNT = 3_000
KEY = shared.KEYS[0]  # the shared cluster asks for a key
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(shared_cluster: RunningCluster) -> RunningCluster:
    """The cluster the e2e tests share (``tests/e2e/shared.py``): flooded, it must survive."""
    return shared_cluster


async def send(nats_url: str) -> dict[str, collections.Counter[str]]:
    nc = await connect_nats(nats_url, "fuzz")
    try:
        return await flood(
            nc, sample_messages("worker-0"), COUNT, device_id="worker-0", deployment_id=MODEL
        )
    finally:
        await close_nats(nc)


def test_malformed_messages_are_refused_counted_and_survived(cluster: RunningCluster) -> None:
    run = runfile.read(cluster.run_file)
    sent = asyncio.run(send(run["nats_url"]))
    assert sum(sum(kinds.values()) for kinds in sent.values()) == COUNT
    deadline = time.monotonic() + 20
    while True:  # every service has counted each malformed message it was sent, by channel
        counts = tally(sent, run["metrics"])
        if all(n == c for rows in counts.values() for n, c in rows.values()):
            break
        assert time.monotonic() < deadline, counts
        time.sleep(0.5)
    assert set(counts) == {"scorer", "scheduler", "worker-0", "gateway"}

    assert not [line for line in cluster.lines if "exited" in line]  # nothing crashed
    # No password shows in a log line (the run file, mode 0600, holds the admin's).
    assert not [line for line in cluster.lines if re.search(r"://[^\s/@:]+:[^\s/@]+@", line)]
    assert cluster.run_file.stat().st_mode & 0o077 == 0
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6
    )
    assert reply.choices[0].message.content  # and it still serves
