"""Hosts joining a cluster: the head's join desk and the joining side's handshake.

``tessera up --listen ADDRESS`` makes NATS reachable on that address and prints
``tessera join nats://ADDRESS:PORT --token TOKEN``. The token is the password of the ``join``
user, who may only ask on ``JOIN`` (never read it) and read the answers under its inbox; the
joining device draws its own user's password and sends it in its request, so the answer —
which every holder of the token may read — carries no secret. The desk (in the ``tessera up``
process, as the admin) makes that user of the joining device's own (``libs/cluster/access.py``:
its telemetry and its work, never another device's, never a placement), writes the server's
config and has it reload before answering. ``tessera token rotate`` draws a new token the
same way, and ``tessera devices revoke ID`` removes one device's user: nats-server closes a
connection whose user a reload removed (tests/integration/test_hostile_device.py), the scorer
is told the device left so its shards move at once, and its work consumer is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from libs.cluster.access import JOIN_USER, AccessControl, with_user
from libs.cluster.servers import NatsCluster, NatsServer
from libs.contracts import (
    DEVICE_LEAVING,
    JOIN,
    JOIN_ANSWER,
    SHARD_TASK,
    TOKEN_ANSWER,
    TOKEN_ROTATE,
    JoinAnswer,
    JoinRequest,
    TokenAnswer,
    TokenRotation,
)
from libs.contracts.channels import DEVICE_REVOKE, REVOKE_ANSWER, work_consumer
from libs.contracts.control import DeviceRevocation, RevocationAnswer
from libs.contracts.device import DeviceLeaving
from libs.runtime import pki
from libs.runtime.bus import Delivery, NatsBus, request
from libs.runtime.nats_client import inbox_of, server_list, tls_context, user_of
from libs.runtime.nats_private import connected
from libs.runtime.pki import ClusterCA

log = logging.getLogger(__name__)


class JoinRefused(RuntimeError):
    """The cluster would not let this host in; the message says why and what to do."""


class JoinDesk:
    """Answers join requests and token rotations for a running ``tessera up``, in a thread of
    its own (the launcher is synchronous)."""

    def __init__(
        self,
        access: AccessControl,
        server: NatsServer | NatsCluster,
        admin_url: str,
        ca_file: Path | None = None,
        rpc_ca: ClusterCA | None = None,
    ) -> None:
        self.access, self.server, self.admin_url = access, server, admin_url
        self.ca_file = ca_file  #: the CA of the server's certificate, when NATS requires TLS
        self.rpc_ca = rpc_ca  #: signs joining devices' certificates (llama.cpp's RPC channel)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="join-desk", daemon=True)
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def joined(self) -> list[str]:
        """The devices that joined from other hosts (kept with the users)."""
        return self.access.joined

    def start(self, timeout_s: float = 10.0) -> JoinDesk:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the join desk did not start: {self._error!r}")
        return self

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # told to start(): it raises with this
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        nc = await connect(
            self.admin_url, self.ca_file, name="join-desk", max_reconnect_attempts=-1
        )
        bus = NatsBus(nc)
        await bus.subscribe(JOIN, self.on_join)
        await bus.subscribe(TOKEN_ROTATE, self.on_rotate)
        await bus.subscribe(DEVICE_REVOKE, self.on_revoke)
        await nc.flush()
        self.bus = bus
        self._ready.set()
        await self._stop.wait()
        await nc.drain()

    async def on_join(self, ask: JoinRequest, msg: Delivery) -> None:
        try:
            if ask.device_id in self.access.devices and ask.device_id not in self.joined:
                raise ValueError(f"{ask.device_id!r} is a worker of this cluster already")
            held = self.access.passwords.get(ask.device_id, "")
            if ask.device_id in self.joined and not secrets.compare_digest(held, ask.password):
                raise ValueError(  # another holder of the token must not take its user over
                    f"{ask.device_id!r} has joined already from another host: only that host "
                    f"joins as it again (`tessera revoke {ask.device_id}` frees the name)"
                )
            certificate = ""
            if ask.csr_pem and self.rpc_ca is not None:
                certificate = self.rpc_ca.sign(ask.csr_pem, ask.device_id)
            password = self.access.admit_joined(ask.device_id, ask.password)
        except ValueError as exc:
            answer = JoinAnswer(device_id=ask.device_id, refused=str(exc))
        else:
            await self._reload(ask.device_id, password)
            answer = JoinAnswer(
                device_id=ask.device_id,
                user=ask.device_id,
                certificate_pem=certificate,
                ca_pem=self.rpc_ca.cert_pem if certificate and self.rpc_ca is not None else "",
            )
            log.info("host joined", extra={"device_id": ask.device_id, "hostname": ask.hostname})
        if msg.reply:
            await self.bus.reply(msg.reply, JOIN_ANSWER, answer)

    async def on_rotate(self, ask: TokenRotation, msg: Delivery) -> None:
        token = self.access.rotate_token()
        await self._reload(JOIN_USER, token)
        log.info("join token rotated")
        if msg.reply:
            await self.bus.reply(msg.reply, TOKEN_ANSWER, TokenAnswer(token=token))

    async def on_revoke(self, ask: DeviceRevocation, msg: Delivery) -> None:
        """Remove the device's user (its connections close at the reload), say it left (its
        shards move now, not after missed heartbeats) and delete its work consumer."""
        device = ask.device_id
        old = self.access.passwords.get(device, "")
        if not self.access.revoke(device):
            answer = RevocationAnswer(device_id=device, refused=f"{device!r} has no user here")
        else:
            await self._reload(None, "")
            deadline = time.monotonic() + 5  # the reload is applied: the old password fails
            for url in server_list(self.server.url):
                while await self._accepts(url, device, old) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            leaving = DeviceLeaving(device_id=device, ts=time.time(), reason="revoked")
            await self.bus.publish(DEVICE_LEAVING, leaving, device_id=device)
            js = self.bus.nc.jetstream()
            with contextlib.suppress(Exception):  # none yet, or no stream: nothing to remove
                await js.delete_consumer(SHARD_TASK.stream or "", work_consumer(device))
            log.warning("device revoked", extra={"device_id": device})
            answer = RevocationAnswer(device_id=device)
        if msg.reply:
            await self.bus.reply(msg.reply, REVOKE_ANSWER, answer)

    async def _reload(self, user: str | None, password: str) -> None:
        """Write the users, have nats-server (every member of a cluster) reload them, and
        wait until each lets ``user`` in with ``password`` (None: wait for nobody)."""
        if self.server.config is not None:
            self.access.write_nats_config(self.server.config)
        self.server.reload()
        deadline = time.monotonic() + 5
        if user is None:
            return
        for url in server_list(self.server.url):
            while not await self._accepts(url, user, password) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

    async def _accepts(self, url: str, user: str, password: str) -> bool:
        try:
            nc = await connect(
                with_user(url, user, password),
                self.ca_file,
                error_cb=_quiet,  # refused until the server has reloaded: expected here
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=1,
            )
        except Exception:
            return False
        await nc.close()
        return True


async def _quiet(exc: Exception) -> None:
    return None


async def connect(url: str, ca_file: Path | None, **options: Any) -> NatsClient:
    """A NATS connection (over TLS trusting ``ca_file`` when given) for the join handshake,
    its replies under its user's own inbox prefix (the only ones it may read)."""
    options.setdefault("inbox_prefix", inbox_of(user_of(url)))
    return await connected(server_list(url), tls=tls_context(ca_file), **options)


#: Where a host keeps the password of each device id it joined as (``device_password``).
SECRETS_DIR = Path.home() / ".local" / "state" / "tessera" / "devices"


def device_password(device_id: str, folder: Path | None = None) -> str:
    """The password this host's ``device_id`` joins with: drawn once and kept (mode 0600) in
    ``folder``, so the host joins as it again after a restart, while another holder of the
    join token, who lacks the file, is refused that name (the desk keeps the first password)."""
    path = (folder or SECRETS_DIR) / f"{device_id}.secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path.with_suffix(".part"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(24))
        os.replace(path.with_suffix(".part"), path)
    return path.read_text().strip()


async def ask_to_join(
    url: str,
    token: str,
    device_id: str,
    ca_file: Path | None = None,
    timeout_s: float = 10.0,
    rpc_folder: Path | None = None,
    secrets_dir: Path | None = None,
) -> str:
    """The NATS URL with this device's own credentials, asked of the cluster at ``url``
    (over TLS when ``ca_file``, the cluster's CA, is given). With ``rpc_folder``, a key made
    there and the certificate the cluster signs for it (``pki.Credentials.in_folder``). The
    password is this host's for ``device_id`` (``device_password`` in ``secrets_dir``)."""
    failure: list[str] = []

    async def on_error(exc: Exception) -> None:
        failure.append(str(exc))

    try:
        connecting = connect(
            with_user(url, JOIN_USER, token),
            ca_file,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            connect_timeout=timeout_s,
            error_cb=on_error,
        )
        nc: NatsClient = await asyncio.wait_for(connecting, timeout_s)
    except Exception as exc:
        said = " ".join([str(exc), *failure]).lower()
        if "tls" in said or "certificate" in said or "ssl" in said:
            raise JoinRefused(tls_trouble(url, ca_file, said)) from exc
        if "authorization" in said:
            raise JoinRefused(
                f"the cluster at {url} refused the token: it is wrong, or it was rotated out "
                "(`tessera token rotate` on the cluster prints the current one)"
            ) from exc
        raise JoinRefused(f"no cluster answers at {url}: {str(exc) or 'unreachable'}") from exc
    try:
        csr = pki.request(rpc_folder, device_id) if rpc_folder is not None else ""
        password = device_password(device_id, secrets_dir)  # only the desk reads the request
        ask = JoinRequest(
            device_id=device_id,
            hostname=socket.gethostname(),
            ts=time.time(),
            csr_pem=csr,
            password=password,
        )
        answer = await request(nc, JOIN, ask, JOIN_ANSWER, timeout_s)
    finally:
        await nc.close()
    if answer.refused:
        raise JoinRefused(f"the cluster refused {device_id}: {answer.refused}")
    if rpc_folder is not None and answer.certificate_pem:
        pki.accept(rpc_folder, answer.certificate_pem, answer.ca_pem)
    return with_user(url, answer.user, password)


def tls_trouble(url: str, ca_file: Path | None, said: str) -> str:
    """What to do when the TLS handshake with the cluster failed."""
    if ca_file is None:
        return (
            f"the cluster at {url} requires TLS: give its CA with --ca (the file `tessera up` "
            "named in its join command, copied to this host)"
        )
    return f"TLS with the cluster at {url} failed with the CA {ca_file}: {said}"


async def rotate_token(admin_url: str, ca_file: Path | None = None, timeout_s: float = 10.0) -> str:
    """A new join token from the running cluster (asked as its admin)."""
    nc = await connect(
        admin_url,
        ca_file,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        connect_timeout=timeout_s,
    )
    try:
        answer = await request(nc, TOKEN_ROTATE, TokenRotation(ts=time.time()), TOKEN_ANSWER, 10)
    finally:
        await nc.close()
    return answer.token


def say_left(access: AccessControl | None, admin_url: str, ca_file: Path | None) -> list[str]:
    """The devices revoked while no cluster ran (``AccessControl.left``), said to have left
    once the scorer listens (their shards move at once, not after a restored plan's wait for
    devices to come back), then forgotten: their ids."""
    if access is None or not access.left:
        return []
    left = list(access.left)

    async def say() -> None:
        options = {"allow_reconnect": False, "max_reconnect_attempts": 0, "connect_timeout": 5}
        nc = await connect(admin_url, ca_file, **options)
        try:
            for device in left:
                why = "revoked while the cluster was down"
                leaving = DeviceLeaving(device_id=device, ts=time.time(), reason=why)
                await NatsBus(nc).publish(DEVICE_LEAVING, leaving, device_id=device)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(say())
    access.left.clear()
    access.save()
    return left


async def revoke_device(
    admin_url: str, device_id: str, ca_file: Path | None = None, timeout_s: float = 10.0
) -> str:
    """Remove ``device_id``'s user from the running cluster (asked as its admin): "" once it
    is gone, else why not."""
    nc = await connect(
        admin_url, ca_file, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
    )
    try:
        ask = DeviceRevocation(device_id=device_id, ts=time.time())
        answer = await request(nc, DEVICE_REVOKE, ask, REVOKE_ANSWER, timeout_s)
    finally:
        await nc.close()
    return answer.refused
