"""The front door and the documentation site: the README stays short, nothing in the project
points outside the repository (a clone has nothing beside it), every link in the README and in
``docs/`` leads to a file that exists, the site builds with warnings as errors, and its
configuration page shows every setting the code reads."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_hooks() -> ModuleType:
    """docs/hooks.py (the site's configuration page and reports), loaded by path."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()

#: Paths that lead out of a checkout: the folder beside it, and this machine's own layout.
#: Written in pieces so this file does not match itself.
OUTSIDE = re.compile("|".join(re.escape(p) for p in ("../" + "shared", "/" + "work/")))
#: A markdown link's target: ``[text](target)`` or ``![alt](target)``.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """Every file git tracks, and every file not ignored that is about to be (the working
    tree as the next commit will hold it)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_the_readme_is_a_front_door_not_a_manual() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    text = "\n".join(lines)
    for must in ("make up", "make test", "docs/dashboard.png", "## A five-minute tour"):
        assert must in text


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert found == [], "paths outside the repository:\n" + "\n".join(found)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.name)
def test_every_link_leads_to_a_file_in_the_repository(page: Path) -> None:
    """As GitHub shows them: relative to the page, inside the checkout, existing."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert broken == [], f"{page.name}: links to nothing: {broken}"


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """What ``make docs`` runs: a broken link, a missing page or an unknown anchor fails it."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    configuration = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "TESSERA_SCHEDULER_CYCLE_MS" in configuration
    assert (tmp_path / "site" / "bench" / "results" / "serving" / "index.html").exists()


def test_the_configuration_page_covers_every_settings_module() -> None:
    """A service added with settings of its own appears on the page, or this fails."""
    modules = {
        str(path.relative_to(ROOT).with_suffix("")).replace("/", ".")
        for path in ROOT.glob("services/*/settings.py")
    }
    assert modules | {"libs.runtime.settings"} == set(hooks.SETTINGS_MODULES)


def test_the_configuration_page_shows_every_field_with_its_variable() -> None:
    """Each variable as the service reads it; a shared field without a shared name is shown
    once, as ``TESSERA_<SERVICE>_…``, and each service's prefix names the service."""
    page = hooks.render_settings()
    for module in hooks.SETTINGS_MODULES:
        for cls in hooks.settings_classes(module):
            prefix = cls.model_config["env_prefix"]
            for name, field in cls.model_fields.items():
                variable = hooks.env_name(cls, name, field)
                if variable.startswith(prefix) and f"`{variable}`" not in page:
                    variable = "TESSERA_<SERVICE>_" + variable.removeprefix(prefix)
                    assert prefix != "TESSERA_" and prefix in page, (cls.__name__, prefix)
                assert f"`{variable}`" in page, (cls.__name__, name)
    assert "`TESSERA_SCHEDULER_CYCLE_MS` | int | `200` |" in page
    assert "`TESSERA_MODEL_DIR`" in page  # read by a function, not a field
    assert str(ROOT) not in page and str(Path.home()) not in page  # nothing of this machine


def test_every_meaning_written_by_hand_names_a_real_field() -> None:
    fields = set()
    for module in hooks.SETTINGS_MODULES:
        for cls in hooks.settings_classes(module):
            fields |= set(cls.model_fields)
    assert set(hooks.MEANINGS) <= fields
