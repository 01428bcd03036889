"""Every benchmark in bench/ runs from a clone, with its smallest arguments: it prints its
JSON report with the figures it promises and writes its Markdown report (the command, the
date, the machine, the table; ``bench/report.py``) into the folder ``--results`` names.

The figures themselves are the benchmarks' to judge (a goal met or not), never a test's: this
only checks that each runs. A benchmark added to bench/ without a case here fails
``test_every_benchmark_has_a_case``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libs.cluster import limits
from libs.harness.lan import UNAVAILABLE
from libs.models.shipped import gguf_path
from services.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
#: What is in bench/ and is no benchmark: the reports' writer, the ingest benchmark's bare
#: reference (it runs as that benchmark's child), the policies benchmark's cloud-size sweep.
HELPERS = {"report", "bare_ingest", "cloud_sizes"}
NO_LLAMA = (
    None
    if (WorkerSettings().llama_bin / ".installed").exists()
    else "no llama.cpp build: `make llama` builds it (`make test` does)"
)
NO_VLLM = (
    None
    if WorkerSettings().vllm_python.exists()
    else "no vLLM virtualenv: `make vllm` builds it (`make test` does)"
)

#: Each benchmark: its smallest arguments, the figures its JSON must hold, and why it cannot
#: run here (None: it can).
CASES: dict[str, tuple[list[str], set[str], str | None]] = {
    "scheduler": (
        ["--devices", "100", "--tasks", "40", "--cycle", "20"],
        {"cycle_tasks", "results"},
        None,
    ),
    "ilp_gap": (
        ["--instances", "2", "--max-jobs", "3", "--max-machines", "2"],
        {"mean_gap"},
        None,
    ),
    "energy_unseen": (["--seeds", "1", "--requests", "20"], set(), None),
    "policies": (
        [
            *("--seeds", "1", "--limit", "40", "--ilp-instances", "1", "--job-traces", "195job"),
            *("--cloud-sizes", "16,64"),
        ],
        {
            "dwps_ilp_mean_gap",
            "simulation_speedup",
            "edgeflow_minus_elasticflow_points_worst_size_trace_draw",
        },
        None,
    ),
    "ingest": (
        ["--devices", "10", "--seconds", "2.5", "--warmup", "1", "--rate", "2000"],
        {"updates_per_s", "bare_pipeline_per_s", "ratio"},
        None,
    ),
    "fuzz": (["--messages", "200"], {"all_counted", "crashes", "chat_after_status"}, None),
    "chaos": (
        ["--requests", "3", "--concurrency", "1", "--max-tokens", "4", "--faults", "worker_kill"],
        {"faults", "all_back_within_goal"},
        None,
    ),
    "gateway": (
        ["--prompts", "1", "--max-tokens", "4", "--rounds", "1"],
        {"gateway_tokens_per_s", "direct_tokens_per_s", "ratio"},
        None,
    ),
    "pipeline": (
        ["--prompts", "1", "--max-tokens", "4"],
        {"tokens_per_s", "ratio_2_1", "identical_tokens"},
        None,
    ),
    "engines": (
        ["--rounds", "1"],
        {"int8_shard_engine_tok_s", "llama_cpp_tok_s", "ratio_int8_llama"},
        NO_LLAMA,
    ),
    "rpc_channel": (
        ["--rounds", "1", "--tokens", "4", "--streams", "1"],
        {"same_greedy_tokens", "goal_met"},
        NO_LLAMA or UNAVAILABLE,
    ),
    "placement": (
        [
            *("--model", str(gguf_path()), "--tokens", "6", "--streams", "2"),
            *("--sweep", "5", "--named-only"),
        ],
        {"dwps_over_best", "dwps_over_exo", "prediction_error_median", "sweep"},
        NO_LLAMA or limits.unavailable(),
    ),
    "kernel_rates": (
        ["--types", "Q8_0,Q4_0", "--tokens", "16", "--streams", "2"],
        {"kernels", "read_share", "op_gflop", "token_gflop", "fit_error_median"},
        NO_LLAMA or limits.unavailable(),
    ),
    "serving": (
        ["--rounds", "1", "--requests", "1", "--levels", "1"],
        {"concurrency", "identical_tokens"},
        NO_LLAMA or NO_VLLM,
    ),
    "jobs_live": (
        # edgeflow: the live policy no other test runs on a cluster (test_batches.py runs edf):
        # ElasticFlow's plan on the cloud and an edge copy of the model the bench deploys.
        [
            "--batch",
            "3",
            "--interactive",
            "2",
            "--jobs",
            "2",
            "--job-size",
            "2",
            "--tokens",
            "4",
            "--policies",
            "edgeflow",
        ],
        {
            "deadlines_met",
            "predicted_deadlines_met",
            "met_of_submitted",
            "interactive_p99_ratio",
            "batch_throughput_ratio",
        },
        NO_LLAMA,
    ),
    "gpu_check": (
        ["--layers", "2", "--hidden", "256", "--tokens", "8"],
        {
            "cpu",
            "gpu",
            "cuda_build",
            "gpu_whole",
            "gpu_cpu_split",
            "rpc_gpu_split",
            "gpu_head_split",
            "gpu_rpc_worker_split",
        },
        NO_LLAMA,
    ),
    "models": (
        [
            *("--size-gb", "0.02", "--rounds", "1", "--links", "none", "--streams", "2"),
            *("--requests", "1", "--skip-split"),
        ],
        {"delivery", "serving"},
        NO_LLAMA or UNAVAILABLE,
    ),
}
pytestmark = pytest.mark.timeout(900)


def test_every_benchmark_has_a_case() -> None:
    assert {p.stem for p in BENCH.glob("*.py")} - HELPERS == set(CASES)


def printed_report(stdout: str) -> dict[str, object]:
    """The JSON object a benchmark printed (one line, or indented over several)."""
    start = next(i for i, line in enumerate(stdout.splitlines()) if line.startswith("{"))
    text = "\n".join(stdout.splitlines()[start:])
    report, _ = json.JSONDecoder().raw_decode(text)
    assert isinstance(report, dict)
    return report


@pytest.mark.parametrize(  # each on its own (two workers: no fixture of the file is shared)
    "name", [pytest.param(n, marks=pytest.mark.xdist_group(f"bench-{n}")) for n in sorted(CASES)]
)
def test_the_benchmark_runs_and_writes_its_report(name: str, tmp_path: Path) -> None:
    args, figures, unavailable = CASES[name]
    if unavailable:
        pytest.skip(unavailable)
    argv = [sys.executable, str(BENCH / f"{name}.py"), *args, "--json"]
    done = subprocess.run(
        [*argv, "--results", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    print(done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    report = printed_report(done.stdout)
    assert report and figures <= set(report), sorted(report)
    written = (tmp_path / f"{name}.md").read_text()
    assert written.startswith("# ")
    assert f"`python bench/{name}.py {' '.join(args)} --json`" in written, written[:500]
    assert "Machine: " in written and "| ---" in written
