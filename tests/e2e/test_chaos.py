"""Each fault of the chaos harness at small scale, under load: nothing lost, no stream with a
token missing or repeated, and the cluster serves again (figures: bench/chaos.py). A worker
that refuses its shard, or is killed while loading it, gets no request, and the model is
placed again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.harness import placement_faults
from libs.harness.chaos import FAULTS, Chaos

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def chaos() -> Iterator[Chaos]:
    harness = Chaos(concurrency=3, max_tokens=6)
    harness.start()
    yield harness
    harness.stop()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_under_load_loses_nothing_and_the_cluster_recovers(
    chaos: Chaos, fault: str
) -> None:
    outcome = chaos.run(fault, requests=9)
    print(fault, outcome.row())  # the figures, with -s
    assert outcome.counts["lost"] == 0, outcome.row()
    assert outcome.counts["corrupt"] == 0, outcome.row()  # no token missing or repeated
    assert outcome.counts["completed"] + outcome.counts["failed"] == 9
    assert outcome.recovery_s is not None, f"{fault} never recovered"
    if fault in placement_faults.FAULTS:
        assert outcome.misrouted == 0, outcome.row()  # only a serving copy gets requests
        assert outcome.replace_s is not None, outcome.row()  # placed again, and serving


def test_one_of_three_nats_servers_killed_under_load_loses_nothing() -> None:
    """NATS as a cluster of three (``tessera up --nats-servers 3``): SIGKILL one server
    mid-load; its clients move to the other two and JetStream (three copies) goes on."""
    harness = Chaos(concurrency=3, max_tokens=6, nats_servers=3)
    harness.start()
    try:
        outcome = harness.run("nats_member_kill", requests=12)
    finally:
        harness.stop()
    assert outcome.counts["lost"] == 0, outcome.row()
    assert outcome.counts["corrupt"] == 0, outcome.row()
    assert outcome.counts["completed"] + outcome.counts["failed"] == 12
    assert outcome.recovery_s is not None, "the cluster never served again"
