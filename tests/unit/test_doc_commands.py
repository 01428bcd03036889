"""Every `tessera …` and `make …` command the README and the docs show exists with the options
it is shown with: the joining and GPU commands a new user copies first among them. The
commands are read from the pages' shell blocks (```bash, and the `$ ` lines of ```console),
not listed here, so a page that names a flag that went away, a subcommand that never was or a
make target the Makefile lacks fails this test."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from libs.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(bash|console|sh)\n(.*?)```", re.DOTALL)
TESSERA = re.compile(r"(?:\S*/)?tessera")


def shell_lines(text: str) -> list[str]:
    """The commands of a page's shell blocks: a continued line joined, comments dropped; in a
    console block only the lines typed (`$ `)."""
    found = []
    for language, body in BLOCK.findall(text):
        for line in body.replace("\\\n", " ").splitlines():
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def commands() -> list[tuple[str, list[str]]]:
    """(page: line, words) of each `tessera` or `make` command, after any VAR=value prefix."""
    out = []
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                    words = words[1:]
                if words and (TESSERA.fullmatch(words[0]) or words[0] == "make"):
                    out.append((f"{page.relative_to(ROOT)}: {part}", words))
    return out


def options_of(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(param.opts, param.secondary_opts)
    return names


def check_tessera(words: list[str]) -> None:
    """``words`` (after ``tessera``) name a command of the CLI and only options it has."""
    command = typer.main.get_command(app)  # typer's own copy of click's classes
    rest = list(words)
    while getattr(command, "commands", None) and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        assert sub is not None, f"no command {rest[0]!r} under {command.name!r}"
        command, rest = sub, rest[1:]
    known = options_of(command)
    for word in rest:
        if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
            name = word.split("=", 1)[0]
            assert name in known, f"{command.name}: no option {name} (it has {sorted(known)})"


MAKEFILE = (ROOT / "Makefile").read_text()
TARGETS = set(re.findall(r"^([a-z][a-z-]*):", MAKEFILE, re.MULTILINE))


def check_make(words: list[str]) -> None:
    """A make target the Makefile has, variables it reads, and `ARGS` that the `tessera`
    command of that target's recipe takes."""
    targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
    assert targets and set(targets) <= TARGETS, f"targets {targets}: the Makefile has {TARGETS}"
    for word in (w for w in words[1:] if "=" in w):
        name, value = word.split("=", 1)
        assert f"$({name})" in MAKEFILE or f"{name} ?=" in MAKEFILE, f"the Makefile reads no {name}"
        if name == "ARGS":
            (target,) = targets
            recipe = MAKEFILE.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
            found = re.search(r"\$\(BIN\)/tessera (\w+)", recipe)
            assert found, f"make {target}'s recipe runs no tessera command"
            check_tessera([found[1], *shlex.split(value)])


SHOWN = commands()


def test_the_pages_show_the_commands_this_test_reads() -> None:
    """The reading works: the join and GPU commands a user copies are among those read."""
    lines = [line for line, _ in SHOWN]
    for wanted in ("make join ADDR=", 'make up ARGS="--listen', "VLLM_PACKAGE=vllm make vllm"):
        assert any(wanted in line for line in lines), wanted


@pytest.mark.parametrize(("line", "words"), SHOWN, ids=[line for line, _ in SHOWN])
def test_each_command_shown_exists_with_its_options(line: str, words: list[str]) -> None:
    if words[0] == "make":
        check_make(words)
    else:
        check_tessera(words[1:])
