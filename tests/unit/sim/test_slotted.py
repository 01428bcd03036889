"""The policies as ElasticFlow's paper and simulator define them, on runs small enough to
check by hand.

Throughput used throughout (iterations/s): 1 GPU 10, 2 GPUs 18, 4 GPUs 30. Slots are 240 s:
events inside a slot wait for its end and are handled together.
"""

from __future__ import annotations

import io
import math

import pytest

from libs.core.edgeflow import EdgeServer
from libs.core.elasticflow import PlanJob, admissible
from libs.sim.baseline_rounds import TiresiasRounds
from libs.sim.data import A100_PROFILES, ITP_TRACES
from libs.sim.job_simulation import JobSimulation
from libs.sim.jobs import JobState, curve, read_itp, read_profile, read_profiles
from libs.sim.round_policies import ElasticFlowRounds

PROFILE = {"bert": read_profile(io.StringIO("global_batch_size,1,2,4\n64,10,18,30\n"))}
HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"


def run(policy: str, gpus: int, *rows: str, edge: list[EdgeServer] | None = None) -> dict:  # type: ignore[type-arg]
    jobs = read_itp(io.StringIO(HEADER + "".join(rows)))
    result = JobSimulation(policy, gpus, edge or []).run(jobs, PROFILE)
    return {j.trace.job_id: j for j in result.jobs}


# "warm" arrives first and opens the slot (0, 240]; "ok" (2,400 iterations by t = 1,000: one
# GPU does it in 240 s) and "hopeless" (40,000 by t = 1,240: even 4 GPUs do only 30,000 in the
# 1,000 s left at t = 240) arrive inside it.
WARM = "warm,0,300,bert,10000,64,1,30\n"
OK = "ok,100,2400,bert,1000,64,1,240\n"


def test_admission_declines_every_arrival_of_a_slot_that_holds_an_unsatisfiable_job() -> None:
    jobs = run("elasticflow", 4, WARM, OK, "hopeless,200,40000,bert,1240,64,4,1333\n")
    # Both are handled at t = 240. Planned together, "hopeless" cannot meet its deadline, so
    # ElasticFlow declines the slot's arrivals together: "ok" too, though it alone fits.
    assert jobs["ok"].declined and jobs["hopeless"].declined
    assert math.isnan(jobs["ok"].finished_s)
    assert not jobs["warm"].declined and jobs["warm"].finished_s < 240
    ok = PlanJob("ok", 2400, 760, {1: 10.0, 2: 18.0, 4: 30.0})
    hopeless = PlanJob("hopeless", 40000, 1000, {1: 10.0, 2: 18.0, 4: 30.0})
    assert admissible([ok], 4, 0.0) and not admissible([ok, hopeless], 4, 0.0)


def test_an_unsatisfiable_job_in_the_next_slot_is_declined_alone() -> None:
    jobs = run("elasticflow", 4, WARM, OK, "hopeless,300,40000,bert,1240,64,4,1333\n")
    assert not jobs["ok"].declined and jobs["ok"].finished_s <= 1000
    assert jobs["hopeless"].declined


def test_the_old_variant_admits_everything() -> None:
    jobs = run("elasticflow-noadmit", 4, WARM, OK, "hopeless,200,40000,bert,1240,64,4,1333\n")
    assert set(jobs) == {"warm", "ok", "hopeless"} and not any(j.declined for j in jobs.values())
    assert jobs["ok"].finished_s <= 1000


def test_edf_gives_min_of_64_batch_size_and_largest_profiled_count() -> None:
    # Both ask for 1 GPU in the trace; EDF ignores it. "early" (batch 64) gets
    # min(64, 64, 4) = 4 GPUs: 300 iterations at 30/s, 10 s. "late" waits for the next round,
    # a slot later, and then has all 4.
    jobs = run("edf", 4, "early,0,300,bert,50,64,1,30\n", "late,0,300,bert,5000,64,1,30\n")
    assert jobs["early"].finished_s == pytest.approx(10.0)
    assert jobs["late"].finished_s == pytest.approx(250.0)
    # Batch size 2 caps it at 2 GPUs: 18/s, 16.7 s.
    small = run("edf", 4, "small,0,300,bert,50,2,1,30\n")
    assert small["small"].finished_s == pytest.approx(300 / 18)


def state(job_id: str, gpus: int, attained: float = 0.0, running: bool = False) -> JobState:
    trace = read_itp(io.StringIO(HEADER + f"{job_id},0,1000,bert,99999,64,{gpus},100\n"))[0]
    return JobState(trace, {gpus: 10.0}, attained_gpu_s=attained)


def test_tiresias_moves_a_running_job_down_at_3250_and_7200_gpu_seconds() -> None:
    policy = TiresiasRounds(4)
    a, b = state("a", 2), state("b", 2)
    first = policy.round([], [a, b], 0.0, 0)
    assert first.placements == {"a": ("cloud", 2), "b": ("cloud", 2)}
    a.placement, b.placement = ("cloud", 2), ("cloud", 2)
    a.attained_gpu_s, b.attained_gpu_s = 3249.0, 3250.0
    c = state("c", 2)
    second = policy.round([a, b], [c], 1000.0, 1)
    # b crossed 3,250 GPU-seconds: queue 1, behind the queue-0 jobs a and c, so it waits.
    assert [s.trace.job_id for s in policy.queues[0]] == ["a", "c"]
    assert [s.trace.job_id for s in policy.queues[1]] == ["b"]
    assert second.placements == {"a": ("cloud", 2), "c": ("cloud", 2)}
    # a reaches 3,250 half a second later (1 GPU-second on 2 GPUs): the next round is then.
    assert second.next_round_s == pytest.approx(1000.5)
    # A (re)started job pays its start: 2 s + 2 × (log2 2 + 1) s.
    assert second.overhead_s == {"c": 6.0}
    b.placement, b.attained_gpu_s = ("none", 0), 7200.0
    policy.round([a, b, c], [], 1240.0, 2)
    assert b in policy.queues[1]  # only running jobs move down
    b.placement = ("cloud", 2)
    policy.round([a, b, c], [], 1480.0, 3)
    assert b in policy.queues[2]


def test_edgeflow_admits_on_the_edge_a_job_the_cloud_cannot() -> None:
    # One GPU. "early" needs it for the whole first slot (300 iterations by t = 35); "late"
    # (200 by t = 45) has no GPU left in that slot, so ElasticFlow declines both arrivals. On
    # an edge server at 0.5 × a GPU "late" ends at 4 + 200 / 5 = 44 s (4 s: its start).
    rows = ("early,0,300,bert,35,64,1,30\n", "late,0,200,bert,45,64,1,20\n")
    cloud_only = run("elasticflow", 1, *rows)
    assert cloud_only["early"].declined and cloud_only["late"].declined
    with_edge = run("edgeflow", 1, *rows, edge=[EdgeServer("e1", 16.0, 0.5)])
    assert with_edge["late"].placement == ("edge:e1", 1)
    assert with_edge["late"].finished_s == pytest.approx(44.0)
    # The cloud decides as ElasticFlow does: "early" is declined with its slot (the edge
    # cannot end it by 35 s). The seed's each-arrival admission takes it into the cloud.
    assert with_edge["early"].declined
    each = run("edgeflow-each", 1, *rows, edge=[EdgeServer("e1", 16.0, 0.5)])
    assert each["late"].placement == ("edge:e1", 1)
    assert each["early"].finished_s == pytest.approx(34.0)  # 4 s start + 30 s
    # Without the memory (bert: 10 GB) the edge cannot take "late": it is declined.
    small = run("edgeflow", 1, *rows, edge=[EdgeServer("e1", 8.0, 0.5)])
    assert small["late"].declined and small["early"].declined


@pytest.mark.parametrize("policy", ["edgeflow-each", "elasticflow-each"])
def test_each_arrival_admission_decides_each_arrival_of_a_slot_that_does_not_fit(
    policy: str,
) -> None:
    # The slot of the first test: ElasticFlow declined "ok" with "hopeless". Decided one at a
    # time (earliest deadline first), "ok" fits beside "warm" and is admitted; "hopeless"
    # fits nowhere (no edge server either) and is declined alone.
    jobs = run(policy, 4, WARM, OK, "hopeless,200,40000,bert,1240,64,4,1333\n", edge=[])
    assert jobs["hopeless"].declined and not jobs["ok"].declined
    assert jobs["ok"].finished_s <= 1000
    # EdgeFlow keeps ElasticFlow's decision: "ok" goes with its slot (and an edge server at
    # 0.1 × a GPU cannot end it by its deadline: 2,400 s alone).
    slow = [EdgeServer("e1", 16.0, 0.1)]
    kept = run("edgeflow", 4, WARM, OK, "hopeless,200,40000,bert,1240,64,4,1333\n", edge=slow)
    assert kept["hopeless"].declined and kept["ok"].declined


@pytest.mark.parametrize("gpus", [16, 64])
def test_edgeflows_cloud_is_elasticflows_job_for_job_and_the_edge_only_adds(gpus: int) -> None:
    """On 195job, where each-arrival admission falls below ElasticFlow at 16 GPUs: every job
    EdgeFlow keeps in the cloud ends when it ends under ElasticFlow, and the edge runs only
    jobs ElasticFlow declined, so EdgeFlow meets every deadline ElasticFlow meets, and more."""
    trace = read_itp((ITP_TRACES / "195job.csv").open())
    profiles = read_profiles(A100_PROFILES)
    edge = [EdgeServer(f"e{i}", 32.0, 0.5 + i / 30) for i in range(16)]  # workstation GPUs
    base = {j.trace.job_id: j for j in JobSimulation("elasticflow", gpus).run(trace, profiles).jobs}
    ours = JobSimulation("edgeflow", gpus, edge).run(trace, profiles)
    on_edge = [j for j in ours.jobs if j.placement[0].startswith("edge:")]
    for job in ours.jobs:
        if job in on_edge:
            assert base[job.trace.job_id].declined
        else:
            theirs = base[job.trace.job_id]
            assert job.declined == theirs.declined
            assert job.finished_s == theirs.finished_s or (
                math.isnan(job.finished_s) and math.isnan(theirs.finished_s)
            )
    met = sum(j.finished_s <= j.trace.deadline_s for j in ours.jobs)
    met_base = sum(j.finished_s <= j.trace.deadline_s for j in base.values())
    assert met >= met_base and any(j.finished_s <= j.trace.deadline_s for j in on_edge)


def test_rule_3_moves_the_job_least_able_to_meet_its_deadline_to_the_edge() -> None:
    # At t = 240 on 2 GPUs: "late" is past its deadline (t = 100) and would hold both GPUs
    # (18/s) for 56 s more; "tight" needs both now (3,600 iterations by t = 480: 2 GPUs do
    # 4,320 in the slot, 1 does 2,400). Priorities (deadline − end with one more step): late
    # 100 − 295.6, tight 480 − 600: late is the lower, so it goes to the one edge server and
    # tight gets the 2 GPUs and meets its deadline.
    rows = "late,0,1000,bert,100,64,2,60\ntight,0,3600,bert,480,64,2,200\n"
    late, tight = (
        JobState(t, curve(PROFILE["bert"], 64)) for t in read_itp(io.StringIO(HEADER + rows))
    )
    policy = ElasticFlowRounds(2, [EdgeServer("e1", 16.0, 0.5)], each=True)
    decision = policy.round([late, tight], [], 240.0, 1)
    assert decision.placements == {"late": ("edge:e1", 1), "tight": ("cloud", 2)}
    # Without the edge ElasticFlow plans "late" first (earliest deadline): it holds both.
    alone = ElasticFlowRounds(2).round([late, tight], [], 240.0, 1)
    assert alone.placements == {"late": ("cloud", 2)}
