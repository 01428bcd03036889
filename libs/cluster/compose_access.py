"""The users and passwords of a ``docker compose`` stack (``tessera access``): the files the
stack's NATS, Redis and services read, with the grants of ``libs/cluster/access.py``."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from libs.cluster.access import REDIS_USERS, AccessControl
from libs.runtime.pki import ClusterCA

#: The worker devices of docker-compose.yml (the last one in its `gpu` profile).
COMPOSE_DEVICES = ("worker-0", "worker-1", "worker-gpu")
#: The user the image's services run as (the Dockerfile's ``useradd --uid``).
IMAGE_UID = 10001


def write_rpc_certificates(folder: Path, devices: list[str]) -> list[str]:
    """A cluster CA (``folder/ca``, kept: a second run reuses it) and each worker device's
    certificate and key (``folder/rpc/DEVICE``: ca.pem, cert.pem, key.pem), with which its
    llama.cpp RPC server is lent to the other containers over mutual TLS. Run as root, the
    device's files are handed to the image's user (mode 0600 kept); else its key is made
    readable to all (the containers run as another user), and that is said (the lines
    returned)."""
    ca = ClusterCA.kept_in(folder / "ca")
    said = []
    for device in devices:
        files = ca.issue(folder / "rpc" / device, device)
        if os.geteuid() == 0:
            for path in (files.ca, files.cert, files.key, files.key.parent):
                os.chown(path, IMAGE_UID, IMAGE_UID)
        else:
            files.key.chmod(0o644)
            files.key.parent.chmod(0o755)
            said.append(f"{files.key}: readable by every user of this host (not run as root)")
    return said


def write_compose(
    access: AccessControl, folder: Path, services: list[str], nats_servers: int = 1
) -> Path:
    """Files for ``docker compose``: nats.conf, users.acl and access.env (every service's
    URLs with its credentials and an API key for the gateway, for ``docker compose
    --env-file``). Returns the env file. ``nats_servers`` 3: the compose profile
    ``nats-cluster`` (``nats``, ``nats-2``, ``nats-3`` routed into one cluster; the
    services are given all three)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = ["nats", *(f"nats-{i}" for i in range(2, nats_servers + 1))]
    config = access.nats_config()
    if nats_servers > 1:  # the same file for every member; a route to itself is skipped
        routes = [f"nats://{name}:6222" for name in names]
        config["cluster"] = {"name": "tessera", "listen": "0.0.0.0:6222", "routes": routes}
    (folder / "nats.conf").write_text(json.dumps(config, indent=2))
    acl = folder / "users.acl"
    acl.write_text("".join(f"user {rule}\n" for rule in access.redis_acl()))
    lines = [
        f"TESSERA_REDIS_ADMIN_PASSWORD={access.passwords['admin']}",
        f"TESSERA_API_KEY={secrets.token_urlsafe(24)}",  # the gateway's, for its users
        f"TESSERA_BATCH_RUNNER_KEY=tsk-batch-{secrets.token_urlsafe(24)}",  # and batch worker's
        "TESSERA_REDIS_URL_BATCH_SENDER="
        + access.redis_url("redis://redis:6379/1", "batch-sender"),  # the gateway's broker
    ]
    for name in [*services, *access.devices]:
        key = name.upper().replace("-", "_")
        servers = ",".join(f"nats://{n}:4222" for n in names)
        lines.append(f"TESSERA_NATS_URL_{key}={access.nats_url(servers, name)}")
        if name in REDIS_USERS:
            db = 1 if name == "batch" else 0
            url = access.redis_url(f"redis://redis:6379/{db}", name)
            lines.append(f"TESSERA_REDIS_URL_{key}={url}")
    env = folder / "access.env"
    env.write_text("\n".join(lines) + "\n")
    env.chmod(0o600)  # read by `docker compose` only
    for mounted in (folder / "nats.conf", acl):  # read inside the containers' own users
        mounted.chmod(0o644)
    return env
