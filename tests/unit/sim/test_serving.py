"""The serving simulator: deterministic, conserves requests, and agrees with hand figures."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from libs.core.catalogue import HYPOTHETICAL_MODELS
from libs.core.energy import SLEEP_AFTER_S, WAKE_S
from libs.core.policies import make_policy
from libs.devices.fleetfile import build, load_fleet
from libs.sim.data import AZURE_CODE
from libs.sim.fleets import BUILTIN, builtin
from libs.sim.metrics import jain_index, slo_s, summarise
from libs.sim.serving import Outcome, ServingSimulation, SimResult
from libs.sim.speed import SpeedModel
from libs.sim.workloads import Request, WorkloadError, poisson, read_azure

MODEL = "llama-3.2-1b-instruct"
TRACE = AZURE_CODE
KEYS = {
    "completed",
    "failed",
    "throughput_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "mean_wait_s",
    "mean_completion_s",
    "energy_j",
    "tokens_per_joule",
    "deadline_satisfaction_ratio",
    "jain_index",
    "decision_p99_us",
}


def fleet(**devices: int) -> list:  # type: ignore[type-arg]
    return build(load_fleet({"seed": 1, "devices": devices}))


def run(policy: str, requests: list[Request], devices: list, seed: int = 0) -> dict:  # type: ignore[type-arg]
    result = ServingSimulation(devices, make_policy(policy), model=MODEL, seed=seed).run(requests)
    metrics = summarise(result)
    for timing in ("wall_s", "decision_p99_us"):  # measured wall-clock times: never repeat
        metrics.pop(timing)
    return metrics


def test_the_azure_reader_and_its_errors() -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:05.4799600,100,0\n"
    )
    requests = read_azure(io.StringIO(text), load=2.0)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.0, 4808, 10),
        (pytest.approx(0.75), 100, 1),
    ]
    with pytest.raises(WorkloadError, match="missing columns"):
        read_azure(io.StringIO("a,b\n1,2\n"))
    with pytest.raises(WorkloadError, match="row 2"):
        read_azure(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\nnot a time,1,1\n"))


@pytest.mark.parametrize("policy", ["dwps", "random", "least_connections", "mlfq"])
def test_same_seed_same_metrics(policy: str) -> None:
    requests = poisson(2.0, 300, np.random.default_rng(4))
    devices = lambda: fleet(phone=4, laptop=3, workstation=1)  # noqa: E731
    assert run(policy, requests, devices(), seed=3) == run(policy, requests, devices(), seed=3)


def test_every_request_completes_or_is_counted_failed_even_when_a_device_drops_out() -> None:
    spec = load_fleet(
        {
            "seed": 1,
            "prefix": "f",
            "devices": {"laptop": 2, "workstation": 1},
            "faults": [{"device": "f-workstation-0", "kind": "drop_out", "at_s": 20}],
        }
    )
    requests = poisson(3.0, 400, np.random.default_rng(5))
    result = ServingSimulation(build(spec), make_policy("dwps"), model=MODEL).run(requests)
    metrics = summarise(result)
    assert metrics["completed"] + metrics["failed"] == 400
    assert metrics["completed"] == 400  # the laptops can take the workstation's work
    later = [o for o in result.outcomes if o.start_s > 20.5]
    assert later and all(o.device != "f-workstation-0" for o in later)


def test_a_device_that_cannot_hold_the_model_gets_nothing() -> None:
    requests = poisson(1.0, 20, np.random.default_rng(6))
    result = ServingSimulation(fleet(watch=2), make_policy("dwps"), model=MODEL).run(requests)
    assert summarise(result)["failed"] == 20


def test_one_request_takes_prefill_plus_one_step_per_token() -> None:
    [device] = fleet(workstation=1)
    request = Request("r0", 0.0, prompt_tokens=500, output_tokens=50)
    result = ServingSimulation([device], make_policy("dwps"), model=MODEL, cycle_s=0.2).run(
        [request]
    )
    [outcome] = result.outcomes
    speed, caps = SpeedModel(HYPOTHETICAL_MODELS[MODEL]), device.capabilities
    expected = speed.prefill_s(caps, 500, 1.0) + 50 * speed.step_s(caps, 1, 1.0)
    assert outcome.start_s == pytest.approx(0.2)  # the next decision cycle
    assert outcome.done_s - outcome.start_s == pytest.approx(expected)


def test_jain_index() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_builtin_fleets() -> None:
    assert set(BUILTIN) == {"seed", "cloud-edge", "gpu-cluster"}
    assert set(builtin("seed").devices) == {"phone", "laptop", "watch", "workstation"}
    with pytest.raises(KeyError, match="built-in"):
        builtin("mars")


def test_cli_json_has_the_documented_keys() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "libs.cli.main",
            "simulate",
            "--workload",
            str(TRACE),
            "--limit",
            "200",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert set(json.loads(out.stdout)) >= KEYS
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "libs.cli.main",
            "simulate",
            "compare",
            "--workload",
            str(TRACE),
            "--limit",
            "100",
            "--policies",
            "dwps,random",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert set(json.loads(out.stdout)["runs"]) == {"dwps", "random"}


def test_a_sleeping_device_wakes_before_it_serves() -> None:
    [device] = fleet(workstation=1)
    late = Request("r0", SLEEP_AFTER_S * 10, prompt_tokens=500, output_tokens=50)
    result = ServingSimulation([device], make_policy("dwps"), model=MODEL, cycle_s=0.2).run([late])
    [outcome] = result.outcomes
    speed, caps = SpeedModel(HYPOTHETICAL_MODELS[MODEL]), device.capabilities
    expected = speed.prefill_s(caps, 500, 1.0) + 50 * speed.step_s(caps, 1, 1.0)
    assert outcome.done_s - outcome.start_s == pytest.approx(WAKE_S + expected)
    # Asleep most of the run: less than a third of what idling throughout would draw.
    assert result.devices[0].emulated.energy_j < device.idle_power_w * result.makespan_s / 3


def test_slo_attainment_counts_requests_within_their_length_scaled_slo() -> None:
    # SLO of a 50-token request: 2 s + 50 × 0.1 s = 7 s.
    outcomes = [
        Outcome(Request("fast", 0.0, 100, 50), "d", 0.0, 0.5, 6.9),
        Outcome(Request("slow", 0.0, 100, 50), "d", 0.0, 0.5, 7.1),
        Outcome(Request("short", 1.0, 100, 10), "d", 1.0, 1.5, 3.9),  # 3 s SLO, took 2.9 s
        Outcome(Request("lost", 0.0, 100, 10)),
    ]
    result = SimResult(outcomes, [], 10.0, [], 0.0)
    assert slo_s(50) == pytest.approx(7.0)
    assert summarise(result)["slo_attainment"] == 0.5  # 2 of 4: a lost request misses it
