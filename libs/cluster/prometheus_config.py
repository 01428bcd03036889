"""A Prometheus configuration for the local cluster: every service's /metrics scraped, the
alert rules of ``deploy/prometheus/rules`` loaded."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_prometheus_config(path: Path, targets: dict[str, str]) -> None:
    """A Prometheus config scraping the local cluster every 5 s, loading the alert rules:
    ``prometheus --config.file <path>``."""
    rules = REPO / "deploy" / "prometheus" / "rules"
    jobs = [{"targets": [target], "labels": {"service": name}} for name, target in targets.items()]
    config = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "rule_files": [str(rules / "*.yml")],
        "scrape_configs": [{"job_name": "tessera", "static_configs": jobs}],
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
