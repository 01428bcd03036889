"""Who may do what: NATS users with subject permissions and Redis ACL users, per service.

``nats_config`` writes a nats-server ``authorization`` block (JSON is valid nats-server
config): one user per service, and one per worker device. Everything a user is not granted is
refused by the server. Every user reads only its own replies: its inbox prefix is
``_INBOX_<user>`` (``libs/runtime/nats_client.py``: ``inbox_of``), never ``_INBOX.>``.

A **device** (``device_grant``) may publish only its own device's announce, telemetry, leaving,
shard status, weights progress and wants, bandwidth probe, token chunks and hidden frames on
subjects that name it as the sender (``TOKENS``: ``…tokens.<request>.<device>``; ``HIDDEN``:
``…hidden.<deployment>.<to>.<from>``; the gateway and the workers take them only from a device
of the request's route), and read only its own work, requests, frames and hints (and every
cancel, announce request and weights want, which carry ids and digests only; it answers a want
for a file it holds, ``libs/weights/lending.py``). Its JetStream is one pull consumer: it may
create (by name and filter subject, ``$JS.API.CONSUMER.CREATE.TESSERA_WORK.worker-<device>.<its
SHARD_TASK subject>``: the server refuses a body whose filter differs), read the info of, and
pull from (``MSG.NEXT``) its own durable consumer, and acknowledge on
``$JS.ACK.TESSERA_WORK.worker-<device>.>``; the model weights' object store it may only read
(stream info, a message by subject or by direct get, no consumer: ``MODEL_READ``). No stream or
consumer administration, no key-value bucket, no stream listing, no Redis user.

The **services** (``service_grants``):
- ``telemetry`` (the emulated fleet, many devices under one agent): every device's announce,
  telemetry and bandwidth probe out; every device's work and hints in. No JetStream.
- ``scorer``: scores, device failed/recovered and announce requests out; announces,
  telemetry, leaving and mode changes in. No JetStream.
- ``scheduler``: placements, deployment status, shard tasks (into the work stream), hints,
  mode changes, checkpoints and announce requests (when it starts) out; placement
  requests, scores, device events, shard status and what the gateway measured in. It is the
  cluster's JetStream administrator: it creates the streams and its key-value buckets
  (leader lease, checkpoints) and reads and writes them, so it keeps
  ``$JS.API.>`` and ``$KV.>`` (never acknowledges: no ``$JS.ACK``). Removing a model
  (``DELETE /models/NAME``) removes its weights from the object store: it may write an
  object's meta (the deletion marker, ``MODEL_DELETE``) and purge its chunks (``$JS.API``),
  never write a chunk.
- ``models``: the compose stack's one-shot ``models`` service (``tessera models
  add-shipped``): writes the model weights' object store (``MODEL_WRITE``), nothing else.
- ``gateway``: placement requests, generation requests, cancels and what each deployment's
  requests measured out; every token chunk
  (filtered by route), placements, device events, scores, deployment status, weights progress
  (the event feed's bars), mode changes and service restarts in. No JetStream.
- ``batch``: placement requests and decisions in (it watches). No JetStream.
- ``join``: the join token's user: may only ask to join (``JOIN``, never read it: the request
  carries the joining device's password) and read its own replies (every join answer, none
  secret).
- ``admin``: everything (the operator's ``tessera`` commands, ``tessera up``'s join desk).
``redis_acl`` gives each service a Redis user with only the key patterns and command
categories it needs; devices and the telemetry service have none. Passwords are drawn per
cluster.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.cluster.jetstream_grants import (
    JETSTREAM_ADMIN,
    MODEL_DELETE,
    MODEL_READ,
    MODEL_WRITE,
    work_grant,
)
from libs.contracts import (
    ANNOUNCE,
    ANNOUNCE_REQUEST,
    CANCEL,
    CHECKPOINT,
    DEPLOYMENT_EVENT,
    DEPLOYMENT_MEASURED,
    DEPLOYMENTS_SNAPSHOT,
    DEVICE_FAILED,
    DEVICE_LEAVING,
    DEVICE_RECOVERED,
    DVFS_HINT,
    GENERATION,
    HIDDEN,
    JOIN,
    MODE_CHANGE,
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    PROBE,
    SCORE,
    SERVICE_RESTART,
    SHARD_STATUS,
    SHARD_TASK,
    TELEMETRY,
    TOKENS,
    WEIGHTS_PROGRESS,
    WEIGHTS_WANT,
)
from libs.runtime.nats_client import inbox_of, server_list
from libs.runtime.private_files import write_private_json

#: The users that talk to Redis (the rest have no Redis user at all).
REDIS_USERS = ("scorer", "scheduler", "gateway", "batch", "batch-sender", "admin")


def inbox(user: str) -> str:
    """The subjects of ``user``'s replies (its connection's inbox prefix: ``inbox_of``)."""
    return f"{inbox_of(user)}.>"


def with_user(url: str, user: str, password: str) -> str:
    """``url`` (nats://host:port, or several comma-separated) with these credentials."""
    parts = (one.partition("://") for one in server_list(url))
    return ",".join(f"{scheme}://{user}:{password}@{rest}" for scheme, _, rest in parts)


@dataclass(frozen=True)
class Grant:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


#: The user a joining host speaks as (``tessera join``): its password is the cluster's token.
JOIN_USER = "join"
#: Names a joining device may not take.
RESERVED = frozenset({"admin", JOIN_USER})


def service_grants() -> dict[str, Grant]:
    """What each service (not device-bound) may publish and subscribe to (the module's
    docstring says why each)."""
    return {
        "telemetry": Grant(  # the emulated fleet: many devices under one agent
            (ANNOUNCE.wildcard, TELEMETRY.wildcard, PROBE.wildcard),
            (SHARD_TASK.wildcard, DVFS_HINT.wildcard, ANNOUNCE_REQUEST.wildcard),
        ),
        "scorer": Grant(
            (
                SCORE.wildcard,
                DEVICE_FAILED.wildcard,
                DEVICE_RECOVERED.wildcard,
                ANNOUNCE_REQUEST.wildcard,
            ),
            (
                ANNOUNCE.wildcard,
                TELEMETRY.wildcard,
                DEVICE_LEAVING.wildcard,
                MODE_CHANGE.wildcard,
                ANNOUNCE_REQUEST.wildcard,
            ),
        ),
        "scheduler": Grant(
            (
                PLACEMENT_DECISION.wildcard,
                DEPLOYMENT_EVENT.wildcard,
                DEPLOYMENTS_SNAPSHOT.wildcard,
                SHARD_TASK.wildcard,
                DVFS_HINT.wildcard,
                MODE_CHANGE.wildcard,
                CHECKPOINT.wildcard,
                ANNOUNCE_REQUEST.wildcard,  # a restarted scheduler asks devices to announce
                *JETSTREAM_ADMIN,
                *MODEL_DELETE,
            ),
            (
                PLACEMENT_REQUEST.wildcard,
                SCORE.wildcard,
                DEVICE_FAILED.wildcard,
                DEVICE_RECOVERED.wildcard,
                SHARD_STATUS.wildcard,
                ANNOUNCE_REQUEST.wildcard,
                DEPLOYMENT_MEASURED.wildcard,  # what the gateway measured: beside the prediction
            ),
        ),
        "gateway": Grant(
            (
                PLACEMENT_REQUEST.wildcard,
                GENERATION.wildcard,
                CANCEL.wildcard,
                DEPLOYMENT_MEASURED.wildcard,  # it times every request
            ),
            (
                TOKENS.wildcard,
                PLACEMENT_DECISION.wildcard,
                DEVICE_FAILED.wildcard,
                DEVICE_RECOVERED.wildcard,
                SCORE.wildcard,  # the dashboard's live feed
                DEPLOYMENT_EVENT.wildcard,
                DEPLOYMENTS_SNAPSHOT.wildcard,
                WEIGHTS_PROGRESS.wildcard,  # the feed's weights progress bars
                MODE_CHANGE.wildcard,
                SERVICE_RESTART.wildcard,  # the feed's restarts, and their metric
                ANNOUNCE_REQUEST.wildcard,
            ),
        ),
        "batch": Grant(
            (), (PLACEMENT_REQUEST.wildcard, PLACEMENT_DECISION.wildcard, ANNOUNCE_REQUEST.wildcard)
        ),
        "models": Grant(MODEL_WRITE, ()),
    }


def device_grant(device_id: str) -> Grant:
    """A worker device: its own telemetry, status, token chunks and hidden frames out (each on
    a subject naming it); its own work (through its own consumer), requests, frames and hints
    in; the model weights read-only."""
    me = {"device_id": device_id}
    return Grant(
        (
            ANNOUNCE.pattern(**me),
            TELEMETRY.pattern(**me),
            DEVICE_LEAVING.pattern(**me),
            SHARD_STATUS.pattern(**me),
            WEIGHTS_PROGRESS.pattern(**me),
            WEIGHTS_WANT.pattern(**me),
            TOKENS.pattern(**me),
            HIDDEN.pattern(sender_id=device_id),
            PROBE.pattern(**me),  # its bandwidth measured: bytes nobody reads
            *work_grant(device_id),
            *MODEL_READ,
        ),
        (
            SHARD_TASK.pattern(**me),
            GENERATION.pattern(**me),
            HIDDEN.pattern(**me),
            CANCEL.wildcard,
            DVFS_HINT.pattern(**me),
            ANNOUNCE_REQUEST.wildcard,
            WEIGHTS_WANT.wildcard,  # lending what this host holds (libs/weights/lending.py)
        ),
    )


@dataclass
class AccessControl:
    """The users of one cluster, with passwords drawn for it. With a ``path`` (the cluster
    home's ``access.json``) they are read from it and written back at every change, before
    the change is answered: a restarted cluster keeps its token, and its joined hosts their
    users."""

    devices: list[str]
    passwords: dict[str, str] = field(default_factory=dict)
    #: The devices that joined from other hosts (``tessera join``), in joining order.
    joined: list[str] = field(default_factory=list)
    #: Devices revoked while no cluster ran: said to have left at the next start (``say_left``).
    left: list[str] = field(default_factory=list)
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.path.exists():
            kept = json.loads(self.path.read_text())
            self.passwords = {**kept["passwords"], **self.passwords}
            self.joined = [d for d in kept.get("joined", ()) if d in self.passwords]
            self.left = [d for d in kept.get("left", ()) if d not in self.passwords]
            self.devices += [d for d in self.joined if d not in self.devices]
        redis_only = ["batch-sender", "admin", "redis-default"]
        for name in [*service_grants(), *self.devices, *redis_only, JOIN_USER]:
            self.passwords.setdefault(name, secrets.token_urlsafe(18))
        self.save()

    def save(self) -> None:
        """Write the users to ``path`` (owner-only, replaced whole: never half-written)."""
        if self.path is None:
            return
        kept = {"passwords": self.passwords, "joined": self.joined, "left": self.left}
        write_private_json(self.path, kept)

    @property
    def token(self) -> str:
        """The cluster's join token: the password of the user that may only ask to join."""
        return self.passwords[JOIN_USER]

    def rotate_token(self) -> str:
        """A new join token; the old one is refused once the server has the new config."""
        self.passwords[JOIN_USER] = secrets.token_urlsafe(24)
        self.save()
        return self.token

    def admit(self, device_id: str, password: str | None = None) -> str:
        """A user for ``device_id`` with a device's permissions and ``password`` (the one a
        joining device drew and sent, which nobody else reads; None: one drawn here); its
        password. A device that joins again gets the new one (the old one stops working)."""
        if device_id in RESERVED or device_id in service_grants():
            raise ValueError(f"{device_id!r} is the name of a service; choose another device id")
        if password is not None and len(password) < 16:
            raise ValueError("a device's password must have at least 16 characters")
        if device_id not in self.devices:
            self.devices.append(device_id)
        self.passwords[device_id] = password or secrets.token_urlsafe(18)
        self.save()
        return self.passwords[device_id]

    def admit_joined(self, device_id: str, password: str) -> str:
        """``admit`` a host that joined from elsewhere, remembered as such."""
        admitted = self.admit(device_id, password)
        if device_id not in self.joined:
            self.joined.append(device_id)
            self.save()
        return admitted

    def revoke(self, device_id: str, offline: bool = False) -> bool:
        """Remove ``device_id``'s user: once the server has the new config it closes the
        device's connections and refuses its password (``offline``: no server runs; the next
        start says it left). False: no such device."""
        if device_id not in self.devices:
            return False
        self.devices.remove(device_id)
        del self.passwords[device_id]
        if device_id in self.joined:
            self.joined.remove(device_id)
        self.left += [device_id] if offline else []
        self.save()
        return True

    def grants(self) -> dict[str, Grant]:
        return {
            **service_grants(),
            **{d: device_grant(d) for d in self.devices},
            JOIN_USER: Grant((JOIN.wildcard,), ()),
        }

    def nats_config(self) -> dict[str, Any]:
        users: list[dict[str, Any]] = [
            {"user": "admin", "password": self.passwords["admin"]}  # operators and tests: all
        ]
        for name, grant in self.grants().items():
            users.append(
                {
                    "user": name,
                    "password": self.passwords[name],
                    "permissions": {
                        "publish": {"allow": list(grant.publish)},
                        "subscribe": {"allow": [*grant.subscribe, inbox(name)]},
                        "allow_responses": True,  # answer requests sent to this user
                    },
                }
            )
        return {"authorization": {"users": users}}

    def write_nats_config(self, path: Path) -> Path:
        path.write_text(json.dumps(self.nats_config(), indent=2))
        path.chmod(0o600)
        return path

    def redis_acl(self, prefix: str = "tessera") -> list[str]:
        """Redis users (``user`` directives): the scorer writes device rows, ranks and
        histories; the scheduler its mode and checkpoints; the gateway the Batch API's keys;
        none flushes or reconfigures (``@dangerous``); the default user is locked."""
        p = prefix
        scorer = " ".join(
            f"~{p}:{k}" for k in ("dev:*", "caps:*", "hist:*", "rank:*", "failed", "stats")
        )
        writes = "-@all +@read +@write +@transaction +@connection -@dangerous"
        rules = {
            "scorer": f"{scorer} %R~{p}:mode %R~{p}:weights {writes}",
            "scheduler": f"~{p}:checkpoints ~{p}:mode ~{p}:weights ~{p}:models ~{p}:models:* "
            f"%R~{p}:* {writes}",
            "gateway": f"%R~{p}:* ~{p}:jobs:* {writes}",
            # Celery's broker (its queues: device.<id>, one per device, and batch.requests)
            # and results, and the dispatcher's jobs: its own keys and pub/sub channels only.
            "batch": f"~celery* ~_kombu.* ~unacked* ~*pidbox* ~device.* ~batch.* ~{p}:batch:* &* "
            "-@all +@read +@write +@pubsub +@transaction +@scripting +@connection +time",
            # The gateway's batch runner: puts requests on the queue of the batches' requests,
            # reads what the batch workers wrote back (answers, beats, training steps) and
            # stops what it gave up; no other queue, no other key.
            # (kombu keeps a queue as one list per priority: batch.requests, batch.requests…3…)
            "batch-sender": "~batch.requests* ~_kombu.binding.batch.requests "
            f"~_kombu.binding_permanent.batch.requests ~{p}:batch:req:* ~{p}:batch:answer:* "
            f"~{p}:batch:stop:* %R~{p}:batch:alive:* %R~{p}:batch:steps:* "
            "-@all +@read +@write +@connection +@transaction -@dangerous",
            "admin": "~* &* +@all",
        }
        users = [f"{name} on >{self.passwords[name]} {rule}" for name, rule in rules.items()]
        # The default user is not "off" but locked by a password drawn here and never given
        # out: Redis (7.0 to 7.2; valkey-io/valkey#3983, redis/redis#14541) replays an
        # append-only file's MULTI/EXEC blocks as the default user and drops them, silently,
        # when that user is off, so a restarted cluster would lose its model registry.
        return [f"default on >{self.passwords['redis-default']} ~* &* +@all", *users]

    def redis_url(self, base: str, user: str) -> str:
        """``base`` (redis://host:port/db) with ``user``'s credentials."""
        scheme, _, rest = base.partition("://")
        return f"{scheme}://{user}:{self.passwords[user]}@{rest}"

    def nats_url(self, base: str, user: str) -> str:
        """``base`` (nats://host:port) with ``user``'s credentials."""
        return with_user(base, user, self.passwords[user])
