"""The traces and throughput profiles shipped in ``data/`` (each folder has its licence and
citation; ``data/README.md`` lists them), so the simulator works from a fresh clone."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
#: One hour of a code-completion service's LLM requests (Azure, November 2023).
AZURE_CODE = DATA / "traces" / "azure-llm-2023" / "code.csv"
#: Deep-learning job traces of GPU clusters, with ElasticFlow's deadlines.
ITP_TRACES = DATA / "traces" / "elasticflow-itp"
#: Training throughput by batch size and GPU count, measured on A100s.
A100_PROFILES = DATA / "profiles" / "elasticflow-throughputs" / "A100"
