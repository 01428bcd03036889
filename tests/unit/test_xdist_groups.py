"""`make test` runs on two workers with pytest-xdist's ``--dist loadgroup``: the tests of one
file (and every user of the e2e shared cluster) must run on one worker, one after another, or
a module's cluster starts once per worker and the shared one twice at once. pytest 9.2 broke
this silently (xdist 3.8 can no longer add the group to a test's id, so every test became its
own group); ``pyproject.toml`` pins below it. This runs a small suite as ``make test`` runs the
real one and checks where each test ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUITE = """
import json, os, pytest

def record(name):
    with open(os.environ["WHERE"], "a") as out:
        out.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    record(f"grouped-{n}")

@pytest.mark.parametrize("n", range(4))
def test_alone(n):
    record(f"alone-{n}")
"""


def test_tests_of_one_group_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    where = tmp_path / "where.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        env={"WHERE": str(where), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = dict(json.loads(line) for line in where.read_text().splitlines())
    assert len(ran) == 8 and set(ran.values()) == {"gw0", "gw1"}, ran  # both workers used
    assert len({ran[f"grouped-{n}"] for n in range(4)}) == 1, ran
