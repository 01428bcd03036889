"""The shape of the code: a pure core, dependencies pointing one way, subjects in one place.

The rooms, and who may use whom:
- ``libs/contracts`` (wire types, Redis layout) uses no other package of ours;
- ``libs/core``, ``libs/devices``, ``libs/sim`` import no network or service library
  (``FORBIDDEN``), even transitively (``libs/devices/host.py`` reads this host through psutil
  and NVML);
- ``libs/runtime`` (service plumbing) knows neither the local cluster nor the test harness;
- ``libs/*`` never imports ``services``; a service never imports another service, the CLI,
  the local cluster or the harness;
- no module of ``libs/`` or ``services/`` imports itself back through others (no import circle,
  at the top of a file or inside a function), nor another module's private name;
- nats-py's private attributes are read in ``libs/runtime/nats_private.py`` alone.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("nats", "redis", "fastapi", "starlette", "uvicorn", "celery", "opentelemetry", "httpx")
#: Packages of libs/ that import none of ``FORBIDDEN``: the contracts, the deployment book, the
#: scheduling core, the device models and the simulator.
PURE_PACKAGES = [
    p
    for p in ("contracts", "deployments", "core", "devices", "sim")
    if (ROOT / "libs" / p).is_dir()
]


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
    onto whose path Anthropic's and Ollama's requests are translated; the batches check their
    requests against OpenAI's and Anthropic's request shapes."""
    gateway = "services.gateway."

    def allowed(path: Path, name: str) -> bool:
        parts = path.relative_to(ROOT / "services" / "gateway").parts
        if not name.startswith(gateway) or len(parts) == 1:
            return True  # the wiring (app.py) and the entry point use every room
        room, used = parts[0], name.removeprefix(gateway).split(".")[0]
        return (
            used in (room, "core", "settings")
            or (used == "openai" and room in ("anthropic", "ollama", "batches"))
            or (used == "anthropic" and room == "batches")
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


# -- import circles ------------------------------------------------------------------------------
def our_modules() -> dict[str, Path]:
    """Every module of ``libs/`` and ``services/`` by its dotted name (a package by its
    ``__init__.py``)."""
    modules = {}
    for top in ("libs", "services"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports, wherever in the file:
    ``import a.b.c`` and ``from a.b.c import x`` import ``a.b.c`` (the longest prefix that is a
    module of ours), ``from a.b import c`` imports ``a.b.c`` where that is a module, else
    ``a.b``; a relative import is resolved against the file's package."""
    found: set[str] = set()

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := known(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                module = target if target in modules else known(base)
                if module:
                    found.add(module)
    found.discard(name)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, in a circle (strongly connected
    components of more than one module, Tarjan's algorithm, without recursion)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in order:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in order:
                    order[step] = low[step] = len(order)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], order[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_the_circle_finder_sees_each_kind_of_import(tmp_path: Path) -> None:
    """It counts imports inside functions, ``from pkg import mod`` as ``pkg.mod``, relative
    imports, and a circle through three modules."""
    files = {
        "p/__init__.py": "",
        "p/a.py": "def late():\n    from p import b\n",
        "p/b.py": "from .c import something\n",
        "p/c.py": "import p.a\n",
        "p/d.py": "from p import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {
        name.removesuffix(".py").replace("/__init__", "").replace("/", "."): tmp_path / name
        for name in files
    }
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.c"} and graph["p.d"] == {"p.a"}
    assert import_circles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_circles_in_libs_or_services() -> None:
    modules = our_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert import_circles(graph) == []


def test_no_module_imports_another_modules_private_name() -> None:
    offenders = []
    for folder in ("libs", "services", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    offenders += [
                        f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")
                    ]
    assert offenders == []


# -- nats-py's private attributes ----------------------------------------------------------------
NATS_PRIVATE = ROOT / "libs" / "runtime" / "nats_private.py"


def nats_private_names() -> set[str]:
    """Every private attribute nats-py's own code sets on its objects or defines on its
    classes (``_nc``, ``_nuid``, ``_server_info``, ``_connect_command``…), read from its
    source."""
    import nats

    names = set()
    for path in Path(nats.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "self" and is_private(node.attr):
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names.update(
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and is_private(item.name)
                )
    return names


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_ours(owner: ast.expr, ours: set[str]) -> bool:
    """Whether an attribute's owner is this object (``self``, ``cls``, ``super()``) or a name
    imported from our own packages."""
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name):
        return owner.func.id == "super"
    return isinstance(owner, ast.Name) and owner.id in ours


def test_nats_private_attributes_are_read_in_one_adapter_only() -> None:
    """An attribute named as one of nats-py's private ones, reached on anything but ``self``,
    ``cls``, ``super()`` or a name imported from our own packages, or by ``getattr``/
    ``hasattr``/``setattr``, is refused outside ``libs/runtime/nats_private.py``."""
    private = nats_private_names()
    assert {"_nc", "_nuid", "_server_info", "_connect_command"} <= private
    offenders = []
    for folder in ("libs", "services", "bench", "tests", "deploy"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == NATS_PRIVATE:
                continue
            tree = ast.parse(path.read_text())
            ours = {
                alias.asname or alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
                if node.module.split(".")[0] in ("libs", "services", "tests", "bench")
                for alias in node.names
            } | {"self", "cls"}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in private:
                    if not is_ours(node.value, ours):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr")
                    and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in private
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")


#: The worker's rooms, and the rooms each may import (``services/worker/__init__.py``).
WORKER_ROOMS = {
    "device": set(),
    "torch": {"device"},
    "rpc": {"device"},
    "served": {"device", "rpc"},
}


def test_the_worker_rooms_import_one_way() -> None:
    def allowed(path: Path, name: str) -> bool:
        room = path.relative_to(ROOT / "services" / "worker").parts[0]
        parts = name.split(".")
        if parts[:2] != ["services", "worker"] or len(parts) < 3 or parts[2] not in WORKER_ROOMS:
            return True
        return parts[2] == room or parts[2] in WORKER_ROOMS[room]

    assert {p.name for p in (ROOT / "services" / "worker").iterdir() if p.is_dir()} >= set(
        WORKER_ROOMS
    )
    for room in WORKER_ROOMS:
        assert wrong_way(f"services/worker/{room}", allowed) == []


def test_no_worker_method_extends_its_parents() -> None:
    """A hook is implemented at one level: an engine kind implements what its parent calls,
    it does not wrap the parent's own (``super()`` only in ``__init__``)."""
    offenders = []
    for path in sorted((ROOT / "services" / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super"
                and node.attr != "__init__"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: super().{node.attr}")
    assert offenders == []


#: The most lines a module of the project's code holds: past it, a file holds more than one room.
MAX_LINES = 400


def test_no_module_of_libs_or_services_is_over_400_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {count} lines"
        for folder in ("libs", "services")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long
