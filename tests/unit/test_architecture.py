"""The shape of the code: a pure core, dependencies pointing one way, subjects in one place.

The rooms, and who may use whom:
- ``libs/contracts`` (wire types, Redis layout) uses no other package of ours;
- ``libs/core``, ``libs/devices``, ``libs/sim`` are pure: no I/O library, even transitively;
- ``libs/runtime`` (service plumbing) knows neither the local cluster nor the test harness;
- ``libs/*`` never imports ``services``; a service never imports another service, the CLI,
  the local cluster or the harness.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("nats", "redis", "fastapi", "starlette", "uvicorn", "celery", "opentelemetry", "httpx")
#: Packages of libs/ that must stay free of I/O: the contracts and the scheduling core.
PURE_PACKAGES = [p for p in ("contracts", "core", "devices", "sim") if (ROOT / "libs" / p).is_dir()]


def imports_of(path: Path) -> list[str]:
    """Every absolute module a file imports (at its top or inside functions)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def wrong_way(folder: str, allowed: Callable[[Path, str], bool]) -> list[str]:
    """``file: module`` for each import of ours under ``folder`` that ``allowed`` refuses."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports_of(path):
            if name.split(".")[0] in ("libs", "services") and not allowed(path, name):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    return found


def package_of(module: str) -> str:
    """``libs.core.x`` → ``libs.core``; ``services.gateway.x`` → ``services.gateway``."""
    return ".".join(module.split(".")[:2])


def test_libs_never_import_services() -> None:
    assert wrong_way("libs", lambda path, name: not name.startswith("services")) == []


def test_no_service_imports_another_or_the_tools_above_it() -> None:
    def allowed(path: Path, name: str) -> bool:
        own = "services." + path.relative_to(ROOT / "services").parts[0]
        if name.startswith("services"):
            return package_of(name) == own
        return package_of(name) not in ("libs.cli", "libs.cluster", "libs.harness")

    assert wrong_way("services", allowed) == []


def test_the_gateways_apis_stand_on_its_core() -> None:
    """The gateway's core imports none of its APIs; an API imports no other, except OpenAI's,
    onto whose path Anthropic's and Ollama's requests are translated."""
    gateway = "services.gateway."

    def allowed(path: Path, name: str) -> bool:
        parts = path.relative_to(ROOT / "services" / "gateway").parts
        if not name.startswith(gateway) or len(parts) == 1:
            return True  # the wiring (app.py) and the entry point use every room
        room, used = parts[0], name.removeprefix(gateway).split(".")[0]
        return used in (room, "core", "settings") or (
            used == "openai" and room in ("anthropic", "ollama")
        )

    assert wrong_way("services/gateway", allowed) == []


def test_contracts_import_no_other_package_of_ours() -> None:
    assert wrong_way("libs/contracts", lambda p, name: name.startswith("libs.contracts")) == []


def test_runtime_knows_neither_the_cluster_nor_the_harness() -> None:
    def allowed(path: Path, name: str) -> bool:
        return package_of(name) not in ("libs.cluster", "libs.harness", "libs.cli")

    assert wrong_way("libs/runtime", allowed) == []


def test_only_benchmarks_tests_and_the_cli_use_the_harness() -> None:
    def allowed(path: Path, name: str) -> bool:
        return package_of(name) != "libs.harness" or path.is_relative_to(ROOT / "libs/harness")

    assert wrong_way("libs", allowed) == []
    assert wrong_way("services", allowed) == []


def test_services_reach_nats_only_through_the_bus() -> None:
    """Handlers are tested on the in-memory bus; what only NATS has stays in two named files
    (the scheduler's checkpoints and leader lease live in JetStream key-value buckets)."""
    allowed = {
        ROOT / "services" / "scheduler" / "checkpoints.py",
        ROOT / "services" / "scheduler" / "leader.py",
    }
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "services").rglob("*.py"))
        if path not in allowed
        for name in imports_of(path)
        if name.split(".")[0] == "nats"
    ]
    assert offenders == []


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_io_library_directly(package: str) -> None:
    offenders = []
    for path in (ROOT / "libs" / package).rglob("*.py"):
        offenders += [f"{path.name}: {n}" for n in imports_of(path) if n.split(".")[0] in FORBIDDEN]
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
    }
    hits = []
    for folder in ("libs", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if path not in allowed and ("os.environ" in text or "os.getenv" in text):
                hits.append(str(path.relative_to(ROOT)))
    assert hits == []
