"""A cluster's home: the folder ``tessera up`` keeps between runs, so that starting it again is
the same cluster.

What it holds (``Home``'s properties name each):
- ``nats/``: JetStream's store (the deployment and work streams, the scheduler's checkpoints,
  the model weights' object store);
- ``redis/``: Redis's append-only file (fsync every second): the model registry, the devices'
  rows and scores, the checkpoints' copy;
- ``access.json``: the NATS users and their passwords, the join token, the joined hosts;
- ``rpc-ca/``: the CA that signs the devices' certificates for llama.cpp's RPC;
- ``keys.json``: the gateway's API keys, each by name, stored hashed (``libs/runtime/api_keys.py``);
- ``settings.json``: what the cluster keeps of its own settings: the NATS port joined hosts
  reconnect to;
- ``logs/access.log``: the gateway's access log (each request's key by name, never the key);
- ``training/``: the training runs' checkpoints (``tessera jobs submit --train``), where the
  batch worker resumes a run and a finished one's weights stay;
- ``version``: the layout's version. A home of a newer layout is refused, never overwritten.

One ``tessera up`` per home: it holds ``lock`` (an ``flock``, dropped by the kernel however the
process ends) and writes its pid there, so a second one is refused naming the first.
Where it is: ``--home DIR``, else ``TESSERA_HOME``, else ``$XDG_DATA_HOME/tessera/<name>``
(``~/.local/share/tessera/default`` by default).
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.cluster.jetstream_check import damaged
from libs.cluster.up_options import StartRefused, choose_port
from libs.runtime.private_files import write_private_json

#: The layout this version writes; ``MIGRATIONS`` bring an older one up to it.
VERSION = 1
#: From layout n to n + 1, in place (none yet: 1 is the first layout).
MIGRATIONS: dict[int, Callable[[Path], None]] = {}


class HomeRefused(StartRefused):
    """A home this process must not use: the message says why and what to do."""


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class Home:
    path: Path

    @property
    def nats_dir(self) -> Path:
        return self.path / "nats"

    @property
    def redis_dir(self) -> Path:
        return self.path / "redis"

    @property
    def access_file(self) -> Path:
        return self.path / "access.json"

    @property
    def rpc_ca_dir(self) -> Path:
        return self.path / "rpc-ca"

    @property
    def keys_file(self) -> Path:
        return self.path / "keys.json"

    @property
    def training_dir(self) -> Path:
        return self.path / "training"

    @property
    def settings_file(self) -> Path:
        return self.path / "settings.json"

    def settings(self) -> dict[str, Any]:
        if not self.settings_file.exists():
            return {}
        kept: dict[str, Any] = json.loads(self.settings_file.read_text())
        return kept

    def keep(self, **changes: Any) -> None:
        """Write ``changes`` into ``settings.json`` (replaced whole)."""
        write_private_json(self.settings_file, {**self.settings(), **changes})

    def nats_port(self, listen: str) -> tuple[int, str | None]:
        """NATS's port on ``listen``: the one of the last run when it is free (joined hosts
        reconnect there), else 4222 when free, else any, kept for the next run; and what to
        say when the kept one was taken."""
        kept = self.settings().get("nats_port")
        port = choose_port(listen, kept or 4222)
        self.keep(nats_port=port)
        if kept and port != kept:
            return port, f"NATS's port {kept} is taken: on {port}, joined hosts must join again"
        return port, None

    @property
    def version_file(self) -> Path:
        return self.path / "version"

    @property
    def lock_file(self) -> Path:
        return self.path / "lock"

    def exists(self) -> bool:
        return self.version_file.exists()

    # -- checks -----------------------------------------------------------------------------
    def check_owner(self) -> None:
        """A home someone else owns is theirs: refused, nothing changed in it."""
        if not self.path.exists():
            return
        uid = self.path.stat().st_uid
        if uid != os.getuid():
            raise HomeRefused(
                f"{self.path} belongs to {owner_name(uid)}, not to {owner_name(os.getuid())}: "
                f"run tessera as {owner_name(uid)}, or give this cluster a home of its own "
                "(--home DIR or TESSERA_HOME)"
            )

    def layout(self) -> int | None:
        """The layout version written in the home (None: a new, empty home)."""
        if not self.version_file.exists():
            leftovers = [p.name for p in self.path.iterdir()] if self.path.exists() else []
            if [n for n in leftovers if n != "lock"]:
                raise HomeRefused(
                    f"{self.path} holds files but no version file ({', '.join(sorted(leftovers))}"
                    "): it is not a Tessera home, or one whose writing was cut short. Move it "
                    "aside, or choose another folder with --home DIR"
                )
            return None
        text = self.version_file.read_text().strip()
        if not text.isdigit():
            raise HomeRefused(
                f"{self.version_file} reads {text[:40]!r}, not a layout version: the home is "
                "damaged; move it aside (nothing was changed) or start over with --fresh"
            )
        return int(text)

    def prepare(self) -> list[str]:
        """Check the home and bring its layout to ``VERSION`` (made when new); what was done,
        for the start's output. Raises ``HomeRefused`` for a home of a newer layout."""
        self.check_owner()
        found = self.layout()
        if found is not None and found > VERSION:
            raise HomeRefused(
                f"{self.path} was written by a newer Tessera (home layout {found}; this one "
                f"reads up to {VERSION}): upgrade Tessera, or start a separate cluster with "
                "--home DIR. Nothing in it was changed"
            )
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.chmod(0o700)  # it holds passwords and keys
        done = []
        if found is None:
            done.append(f"new home {self.path}")
        else:
            for version in range(found, VERSION):
                MIGRATIONS[version](self.path)
                done.append(f"home migrated from layout {version} to {version + 1}")
        for folder in (self.nats_dir, self.redis_dir):
            folder.mkdir(exist_ok=True, mode=0o700)
        self.version_file.write_text(f"{VERSION}\n")
        return done

    def check_store(self) -> None:
        """Refuse a JetStream store nats-server would cut (``jetstream_check.py``), naming
        the damaged blocks and what to do; nothing is changed."""
        found = damaged(self.nats_dir)
        if not found:
            return
        first = found[0].split(": ", 1)[0]
        raise HomeRefused(
            f"the NATS store in {self.nats_dir} is damaged ({'; '.join(found)}): nats-server "
            "would drop every message of that block from the damaged record on. Nothing was "
            f"changed. Restore {self.path} from a backup; or, to start without what that "
            f"block holds, move it aside (`mv {first} {first}.damaged`) and start again; or "
            "start over (`tessera up --fresh`)"
        )

    # -- one cluster per home ---------------------------------------------------------------
    def lock(self) -> int:
        """Hold the home for this process (the descriptor: keep it open while the cluster
        runs). A second ``tessera up`` on it is refused, naming the first."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise HomeRefused(
                f"another `tessera up` (pid {holder}) runs on {self.path}: stop it first, or "
                "start a second cluster with a home of its own (--home DIR)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    # -- starting over ----------------------------------------------------------------------
    def contents(self) -> list[str]:
        """What ``wipe`` deletes, one line each."""
        said = {
            self.nats_dir: "the NATS store (model files, deployments, checkpoints)",
            self.redis_dir: "Redis's data (model registry, device rows and scores)",
            self.access_file: "the NATS users' passwords, the join token, the joined hosts",
            self.rpc_ca_dir: "the CA of llama.cpp's RPC certificates",
            self.keys_file: "the gateway's API keys",
            self.settings_file: "the cluster's kept settings (its NATS port)",
            self.path / "logs": "the gateway's access log",
            self.training_dir: "the training runs' checkpoints",
        }
        return [f"{path}: {what}" for path, what in said.items() if path.exists()]

    def wipe(self) -> list[str]:
        """Delete what the home holds (a held lock is kept: the caller holds it); what went."""
        gone = self.contents()
        kept = (self.nats_dir, self.redis_dir, self.rpc_ca_dir, self.path / "logs")
        for path in (*kept, self.training_dir):
            shutil.rmtree(path, ignore_errors=True)
        for path in (self.access_file, self.keys_file, self.settings_file, self.version_file):
            path.unlink(missing_ok=True)
        return gone


def open_home(path: Path, fresh: bool = False) -> tuple[Home, int, list[str]]:
    """The home at ``path``, checked, locked for this process and brought to ``VERSION``
    (emptied first with ``fresh``): the home, its lock's descriptor (keep it open while the
    cluster runs) and what was done, to say at start."""
    home = Home(path)
    home.check_owner()
    lock = home.lock()
    try:
        notes = [f"deleted {line}" for line in home.wipe()] if fresh else []
        notes += home.prepare()
        home.check_store()
        return home, lock, notes
    except BaseException:
        os.close(lock)
        raise
