"""Gandiva as ElasticFlow's simulator runs it (``libs/sim/gandiva.py``), on runs small enough to
check by hand, and against the figures their simulator gives on the shipped traces.

Nodes have 8 GPUs; a job runs the trace's GPU count for the trace's duration. Rounds happen
only at arrivals (merged per 240 s slot) and then every 240 s; while arrivals remain, each
placed one-GPU job loses 2 + 2 × (log2 1 + 1) = 4 s per round. Times are relative to the first
submission; the trace's own clock decides when a set's jobs rotate.
"""

from __future__ import annotations

import io

import pytest

from libs.sim.data import A100_PROFILES, ITP_TRACES
from libs.sim.gandiva import GandivaCluster
from libs.sim.job_simulation import JobSimulation
from libs.sim.jobs import JobState, TraceJob, read_itp, read_profile, read_profiles

PROFILE = {"bert": read_profile(io.StringIO("global_batch_size,1,2,4\n64,10,18,30\n"))}
HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"


def run(gpus: int, *rows: str) -> dict[str, float]:
    """Each job's end (s after the first submission) under Gandiva on ``gpus`` GPUs."""
    trace = read_itp(io.StringIO(HEADER + "".join(rows)))
    result = JobSimulation("gandiva", gpus).run(trace, PROFILE)
    return {j.trace.job_id: j.finished_s for j in result.jobs}


def job(name: str, gpus: int) -> JobState:
    return JobState(TraceJob(name, 0.0, 100.0, "bert", 1000.0, 64, gpus, 100.0), {gpus: 1.0})


def test_jobs_go_to_node_sets_of_their_gpu_count() -> None:
    cluster = GandivaCluster(free_nodes=2)
    for i in range(7):
        assert cluster.place(job(f"one{i}", 1))
    # Seven one-GPU jobs share one node: their test for joining a set is strict (7 + 1 < 8
    # fails), so the eighth opens a set on the other node.
    assert [len(s.jobs) for s in cluster.sets[1]] == [7]
    assert cluster.place(job("one7", 1))
    assert sorted(len(s.jobs) for s in cluster.sets[1]) == [1, 7]
    assert cluster.free_nodes == 0
    # No free node: a 4-GPU job has no set of its class and waits; a one-GPU job is packed
    # onto the least loaded one-GPU set and time-sliced there.
    assert not cluster.place(job("four", 4))
    assert cluster.place(job("one8", 1))
    assert sorted(len(s.jobs) for s in cluster.sets[1]) == [2, 7]
    # A 16-GPU job takes a set of two whole nodes.
    big = GandivaCluster(free_nodes=3)
    assert big.place(job("sixteen", 16))
    assert (big.sets[16][0].nodes, big.sets[16][0].capacity, big.free_nodes) == (2, 1, 1)


def test_a_class_above_its_share_packs_its_jobs_onto_fewer_nodes() -> None:
    cluster = GandivaCluster(free_nodes=2)
    for i in range(8):
        cluster.place(job(f"one{i}", 1))
    # Demand 8 GPUs, held 16: the class gives back its least loaded set (one job) and deals
    # that job onto the other, which now runs all 8 at once on one node.
    cluster.adjust()
    assert [len(s.jobs) for s in cluster.sets[1]] == [8]
    assert cluster.free_nodes == 1


def test_a_packed_job_waits_until_the_one_ahead_ends_and_the_next_round_comes() -> None:
    # One node, two 8-GPU jobs: a set runs one job of 8 GPUs at a time, so "second" is packed
    # behind "first". No arrivals remain, so rounds come every 240 s and no overhead is charged:
    # "first" ends at 100 s, but "second" starts only at the round at 240 s and ends at 290 s.
    ends = run(8, "first,0,100,bert,1000,64,8,100\n", "second,0,50,bert,1000,64,8,50\n")
    assert ends == {"first": pytest.approx(100.0), "second": pytest.approx(290.0)}


def test_jobs_rotate_only_in_rounds_on_a_whole_minute_of_the_trace_clock() -> None:
    # Two 8-GPU jobs of 300 s packed on one node. Their time-slicing swaps a set's jobs in a
    # round whose second on the trace's clock is a multiple of 60. Submitted at 0, every round
    # (0, 240, 480, …) is: they alternate, "first" running (0, 240] and (480, 720].
    rows = ("first,0,300,bert,1000,64,8,300\n", "second,0,300,bert,1000,64,8,300\n")
    assert run(8, *rows) == {"first": pytest.approx(540.0), "second": pytest.approx(780.0)}
    # Submitted at 30 s, no round is (30, 270, 510, …): each runs to its end in turn.
    late = ("first,30,300,bert,1030,64,8,300\n", "second,30,300,bert,1030,64,8,300\n")
    assert run(8, *late) == {"first": pytest.approx(300.0), "second": pytest.approx(780.0)}


def test_rounds_come_only_at_arrivals_merged_per_slot_and_charge_overheads() -> None:
    ends = run(
        8,
        "long,0,1000,bert,9000,64,1,1000\n",
        "short,100,50,bert,9000,64,1,50\n",
        "late,5000,50,bert,9000,64,1,50\n",
    )
    # "short" arrives inside the slot (0, 240] and starts at 240 s; it loses 4 s there, so it
    # ends at 294 s. "long" loses 4 s at 0 and at 240 s: 1,000 s of work ends at 1,008 s.
    # Nothing else happens until "late" arrives at 5,000 s, the last arrival: no overhead.
    assert ends == {
        "long": pytest.approx(1008.0),
        "short": pytest.approx(294.0),
        "late": pytest.approx(5050.0),
    }


def test_a_job_too_big_for_the_cloud_never_runs_and_the_rest_do() -> None:
    ends = run(8, "huge,0,100,bert,1000,64,16,100\n", "small,0,100,bert,1000,64,1,100\n")
    assert ends["small"] == pytest.approx(100.0)
    assert ends["huge"] != ends["huge"]  # NaN: never finished
    with pytest.raises(ValueError, match="at least one GPU"):
        JobSimulation("gandiva", 0).run([], PROFILE)


@pytest.mark.parametrize(
    ("trace", "gpus", "met"),
    [
        ("195job", 128, 47),
        ("cluster01", 512, 386),
        ("cluster03", 512, 911),
        ("cluster05", 512, 828),
    ],
)
def test_the_shipped_traces_give_what_elasticflows_simulator_gives(
    trace: str, gpus: int, met: int
) -> None:
    """Deadlines met by pkusys/ElasticFlow's ``scheduler.py --schedule=gandiva --scheme=gandiva
    --simulation=True --scheduling_slot=240`` at ``n16g8`` (195job: 0.2410) and ``n64g8``
    (0.2420, 0.3026, 0.2282), run 2026-11-25; every job's end time matched theirs."""
    jobs = read_itp((ITP_TRACES / f"{trace}.csv").open())
    result = JobSimulation("gandiva", gpus).run(jobs, read_profiles(A100_PROFILES))
    assert sum(j.finished_s <= j.trace.deadline_s for j in result.jobs) == met
