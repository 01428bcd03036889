"""The shape of the code: a pure core, subjects written in one place."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("nats", "redis", "fastapi", "starlette", "uvicorn", "celery", "opentelemetry", "httpx")
#: Packages of libs/ that must stay free of I/O: the contracts and the scheduling core.
PURE_PACKAGES = [p for p in ("contracts", "core", "devices", "sim") if (ROOT / "libs" / p).is_dir()]


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_io_library_directly(package: str) -> None:
    offenders = []
    for path in (ROOT / "libs" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_pull_in_no_io_library_transitively(package: str) -> None:
    code = (
        f"import sys, libs.{package}; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_subject_strings_appear_only_in_the_contracts() -> None:
    allowed = ROOT / "libs" / "contracts" / "channels.py"
    hits = []
    for folder in ("libs", "services", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != allowed and "tessera.v1." in path.read_text():
                hits.append(str(path.relative_to(ROOT)))
    assert hits == []


def test_environment_is_read_only_by_settings() -> None:
    allowed = {
        ROOT / "libs" / "runtime" / "settings.py",
        ROOT / "libs" / "runtime" / "launcher.py",
        ROOT / "services" / "worker" / "local.py",  # starts worker processes, as the launcher does
    }
    hits = []
    for folder in ("libs", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if path not in allowed and ("os.environ" in text or "os.getenv" in text):
                hits.append(str(path.relative_to(ROOT)))
    assert hits == []
