"""The deep-learning job simulator: hand-checkable runs and the policies' differences."""

from __future__ import annotations

import io

import pytest

from libs.core.edgeflow import EdgeServer
from libs.sim.jobs import JobSimulation, read_itp, read_profile
from libs.sim.workloads import WorkloadError

PROFILE = read_profile(io.StringIO("global_batch_size,1,2,4\n64,10,18,30\n"))
HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"


def trace(*rows: str) -> list:  # type: ignore[type-arg]
    return read_itp(io.StringIO(HEADER + "".join(rows)))


def test_a_single_job_runs_at_the_profiled_rate() -> None:
    jobs = trace("a,1000,300,bert,1100,64,1,30\n")
    result = JobSimulation("edf", 4).run(jobs, {"bert": PROFILE})
    assert result.jobs[0].finished_s == pytest.approx(30.0)  # 300 iterations at 10/s, 1 GPU
    elastic = JobSimulation("elasticflow", 4).run(jobs, {"bert": PROFILE})
    assert elastic.jobs[0].finished_s == pytest.approx(10.0)  # leftover GPUs: 4 at 30/s


def test_edgeflow_saves_a_job_the_cloud_alone_cannot() -> None:
    # One GPU: "early" needs it now. "late" would end at 50 > 45 after it, but at 40 on the
    # edge (200 iterations at 5 it/s).
    jobs = trace("early,0,300,bert,35,64,1,30\n", "late,0,200,bert,45,64,1,20\n")
    edge = [EdgeServer("e", 16.0, 0.5)]
    cloud_only = JobSimulation("elasticflow", 1).run(jobs, {"bert": PROFILE})
    with_edge = JobSimulation("edgeflow", 1, edge).run(jobs, {"bert": PROFILE})
    assert cloud_only.deadline_satisfaction_ratio == 0.5
    assert with_edge.deadline_satisfaction_ratio == 1.0


def test_bad_traces_and_policies_are_refused() -> None:
    with pytest.raises(WorkloadError, match="missing columns"):
        read_itp(io.StringIO("a,b\n1,2\n"))
    with pytest.raises(ValueError, match="unknown job policy"):
        JobSimulation("teleport", 1)
