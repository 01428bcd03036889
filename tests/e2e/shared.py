"""The cluster that the e2e tests which only use it share (``shared_cluster`` in
``conftest.py``): one `tessera up` for the API tests, the gateway's, the NATS fuzzing and
Prometheus', instead of one each. What it is started with is the union of what they need; a
test that breaks, restarts or reconfigures a cluster starts its own instead.

- the llamacpp engine (the API tests' tool calls need its grammar), two CPU workers (what
  Prometheus is to find) and four emulated devices (telemetry for Prometheus);
- API keys, one per test module that asks with its own; no per-client rate limit (the
  fuzzing and the API tests send many requests; ``test_rate_limits.py`` tests rates), and at
  most ``MAX_CONCURRENT`` requests in flight with bodies up to 64 KiB and files up to 1 MiB
  (the gateway's limits);
- spans written to ``SPANS`` (the API tests read them), workers reporting every 0.5 s.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tests.e2e.cluster import RunningCluster

#: The API keys: the API tests' (``test_apis.py``), the gateway tests' (``test_gateway.py``),
#: the several-models test's (``test_several_models.py``) and the Batch API's
#: (``test_batches.py``).
KEYS = ("test-key-apis", "test-key-1", "test-key-models", "test-key-batches")
MAX_CONCURRENT = 2
#: The largest file the Batch API takes here (``test_batches.py`` sends one byte more).
FILES_MAX_BYTES = 1_048_576
SPANS = Path(tempfile.mkdtemp(prefix="tessera-shared-spans-"))


def start() -> RunningCluster:
    return RunningCluster(
        "--engine",
        "llamacpp",
        devices=4,
        env={
            "TESSERA_GATEWAY_API_KEYS": json.dumps(list(KEYS)),
            "TESSERA_GATEWAY_MAX_CONCURRENT": str(MAX_CONCURRENT),
            "TESSERA_GATEWAY_MAX_BODY_BYTES": "65536",
            "TESSERA_GATEWAY_FILES_MAX_BYTES": str(FILES_MAX_BYTES),
            "TESSERA_GATEWAY_RATE_PER_S": "100000",
            "TESSERA_OTLP_ENDPOINT": f"file://{SPANS}",
            "TESSERA_WORKER_INTERVAL_S": "0.5",
        },
    )
