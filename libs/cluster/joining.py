"""Hosts joining a cluster: the head's join desk and the joining side's handshake.

``tessera up --listen ADDRESS`` makes NATS reachable on that address and prints
``tessera join nats://ADDRESS:PORT --token TOKEN``. The token is the password of the ``join``
user, who may only ask on ``JOIN``; the desk (in the ``tessera up`` process, as the admin)
answers with a user of the joining device's own (``libs/cluster/access.py``: its telemetry and
its work, never another device's, never a placement), writes the server's config and has it
reload before answering. ``tessera token rotate`` draws a new token the same way.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time

import nats
from nats.aio.client import Client as NatsClient

from libs.cluster.access import JOIN_USER, AccessControl, with_user
from libs.cluster.servers import NatsServer
from libs.contracts import (
    JOIN,
    JOIN_ANSWER,
    TOKEN_ANSWER,
    TOKEN_ROTATE,
    JoinAnswer,
    JoinRequest,
    TokenAnswer,
    TokenRotation,
)
from libs.runtime.bus import Delivery, NatsBus, request

log = logging.getLogger(__name__)


class JoinRefused(RuntimeError):
    """The cluster would not let this host in; the message says why and what to do."""


class JoinDesk:
    """Answers join requests and token rotations for a running ``tessera up``, in a thread of
    its own (the launcher is synchronous)."""

    def __init__(self, access: AccessControl, server: NatsServer, admin_url: str) -> None:
        self.access, self.server, self.admin_url = access, server, admin_url
        self.joined: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="join-desk", daemon=True)
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

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
        nc = await nats.connect(self.admin_url, name="join-desk", max_reconnect_attempts=-1)
        bus = NatsBus(nc)
        await bus.subscribe(JOIN, self.on_join)
        await bus.subscribe(TOKEN_ROTATE, self.on_rotate)
        await nc.flush()
        self.bus = bus
        self._ready.set()
        await self._stop.wait()
        await nc.drain()

    async def on_join(self, ask: JoinRequest, msg: Delivery) -> None:
        try:
            if ask.device_id in self.access.devices and ask.device_id not in self.joined:
                raise ValueError(f"{ask.device_id!r} is a worker of this cluster already")
            password = self.access.admit(ask.device_id)
        except ValueError as exc:
            answer = JoinAnswer(device_id=ask.device_id, refused=str(exc))
        else:
            await self._reload(ask.device_id, password)
            answer = JoinAnswer(device_id=ask.device_id, user=ask.device_id, password=password)
            if ask.device_id not in self.joined:
                self.joined.append(ask.device_id)
            log.info("host joined", extra={"device_id": ask.device_id, "hostname": ask.hostname})
        if msg.reply:
            await self.bus.reply(msg.reply, JOIN_ANSWER, answer)

    async def on_rotate(self, ask: TokenRotation, msg: Delivery) -> None:
        token = self.access.rotate_token()
        await self._reload(JOIN_USER, token)
        log.info("join token rotated")
        if msg.reply:
            await self.bus.reply(msg.reply, TOKEN_ANSWER, TokenAnswer(token=token))

    async def _reload(self, user: str, password: str) -> None:
        """Write the users, have nats-server reload them, and wait until it lets ``user`` in
        with ``password``."""
        if self.server.config is not None:
            self.access.write_nats_config(self.server.config)
        if self.server.process is not None:
            self.server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not await self._accepts(user, password) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _accepts(self, user: str, password: str) -> bool:
        try:
            nc = await nats.connect(
                with_user(self.server.url, user, password),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=1,
            )
        except Exception:
            return False
        await nc.close()
        return True


async def ask_to_join(url: str, token: str, device_id: str, timeout_s: float = 10.0) -> str:
    """The NATS URL with this device's own credentials, asked of the cluster at ``url``."""
    failure: list[str] = []

    async def on_error(exc: Exception) -> None:
        failure.append(str(exc))

    try:
        connecting = nats.connect(
            with_user(url, JOIN_USER, token),
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            connect_timeout=timeout_s,
            error_cb=on_error,
        )
        nc: NatsClient = await asyncio.wait_for(connecting, timeout_s)
    except Exception as exc:
        said = " ".join([str(exc), *failure]).lower()
        if "authorization" in said:
            raise JoinRefused(
                f"the cluster at {url} refused the token: it is wrong, or it was rotated out "
                "(`tessera token rotate` on the cluster prints the current one)"
            ) from exc
        raise JoinRefused(f"no cluster answers at {url}: {str(exc) or 'unreachable'}") from exc
    try:
        ask = JoinRequest(device_id=device_id, hostname=socket.gethostname(), ts=time.time())
        answer = await request(nc, JOIN, ask, JOIN_ANSWER, timeout_s)
    finally:
        await nc.close()
    if answer.refused:
        raise JoinRefused(f"the cluster refused {device_id}: {answer.refused}")
    return with_user(url, answer.user, answer.password)


async def rotate_token(admin_url: str, timeout_s: float = 10.0) -> str:
    """A new join token from the running cluster (asked as its admin)."""
    nc = await nats.connect(
        admin_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=timeout_s
    )
    try:
        answer = await request(nc, TOKEN_ROTATE, TokenRotation(ts=time.time()), TOKEN_ANSWER, 10)
    finally:
        await nc.close()
    return answer.token
