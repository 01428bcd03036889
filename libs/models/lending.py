"""Model files lent from host to host: a device that needs a model's file receives it straight
from a device that holds it, over TCP connections, sent by the kernel (``sendfile``). This is
the lender and the wire; ``libs/models/borrowing.py`` is the asker's half.

The object store (``libs/models/weights.py``) carries every chunk through nats-server, which on
a small host costs about a CPU-second per gigabyte and shares the cores with the receiver's
hashing and writing; a device holding the file sends it with the kernel's ``sendfile``,
nothing in between (docs/models.md has both measured against a raw copy). The object store
stays the fallback: where no device lends the file, or a lent copy fails, the fetch goes on
from the store.

- **Asking** (``borrow``): the device publishes a ``WeightsWant`` on ``WEIGHTS_WANT`` — a
  subject naming the asker, which only the asker's NATS user may publish to — and takes the
  first ``WeightsOffer`` a holder answers within ``ASK_WAIT_S``, on the asker's own inbox
  (nobody else reads it).
- **Lending** (``Lender``, run by each worker): it answers a want only for a file this host
  knows hashes to the model's sha256 (``local_files.verified_path``: the file a ``models add``
  hashed here, or one a worker loaded or fetched), never for a path a request names. The offer
  carries its address and a ticket: 128 random bits, sent to the asker's inbox alone, good for
  ``TICKET_USES`` connections to that one file within ``TICKET_S`` (an asker receives the file
  in several stripes at once). A connection that presents no live ticket gets ``ERR`` and
  nothing else.
- **Checking** (``borrowing``): what arrives is checked as it is written, against the store's
  index of the file's chunks or the card's sha256; a file that does not match is thrown away
  and fetched from the store. A holder can therefore deny (the fetch falls back) but never
  corrupt a model.

What it grants is what the object store already grants a device (``MODEL_READ``: any model's
weights): a revoked device has no NATS user, so it gets no ticket. The bytes travel in the
clear, as they do through a NATS link without TLS; so where the cluster's NATS uses TLS
nothing is lent (``lends``): the weights come from the store, encrypted.

The wire: the asker sends ``<ticket> <offset> [<bytes>]\\n``; the lender answers ``OK <bytes>\\n``
and sends that many bytes of the file from ``offset`` (to its end where none are named), or
``ERR <reason>\\n``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from libs.contracts import WEIGHTS_WANT, WeightsOffer, WeightsWant
from libs.models.local_files import verified_path

log = logging.getLogger(__name__)

#: Seconds an asker waits for a holder's offer before it goes to the object store.
ASK_WAIT_S = 0.5
#: Seconds a ticket stays good.
TICKET_S = 30.0
#: Connections a ticket opens at most (the stripes of one fetch, ``borrowing.MAX_STREAMS``, and
#: a few more for the runs a resumed fetch still lacks).
TICKET_USES = 16
#: Seconds a lender waits for a connection's request line, and an asker for any byte.
IO_WAIT_S = 30.0


def lends(nc: NatsClient) -> bool:
    """Whether devices on this connection's cluster lend files: only where its NATS link is
    not encrypted (a lent file is not): no TLS context given, no ``tls://`` server, and a
    server that does not require TLS."""
    url = nc.connected_url
    info = getattr(nc, "_server_info", None) or {}
    return not (nc.options.get("tls") or (url and url.scheme == "tls") or info.get("tls_required"))


@dataclass
class Ticket:
    path: Path
    size_bytes: int
    asker: str
    expires: float
    uses: int = TICKET_USES


class Lender:
    """Lends this host's verified model files: answers ``WEIGHTS_WANT`` for files it holds and
    sends them to connections that present the ticket it gave."""

    def __init__(
        self, nc: NatsClient, device_id: str, host: str, port: int = 0,
        cache_dir: Path | None = None,
    ) -> None:  # fmt: skip
        self.nc, self.device_id, self.host, self.port = nc, device_id, host, port
        self.cache_dir = cache_dir
        self.tickets: dict[str, Ticket] = {}
        self.server: asyncio.Server | None = None
        self.sub: Subscription | None = None
        self.lent = 0  #: connections that sent all they were asked
        self.sent = 0  #: the bytes those connections sent

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        self.sub = await self.nc.subscribe(WEIGHTS_WANT.wildcard, cb=self._on_want)
        log.info("lending model files", extra={"endpoint": self.endpoint})

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5.0)

    async def _on_want(self, msg: Msg) -> None:
        asker = msg.subject.rsplit(".", 1)[-1]
        try:
            want = WeightsWant.model_validate_json(msg.data)
        except ValidationError:
            return
        if want.device_id != asker or asker == self.device_id or not msg.reply:
            return
        path = await asyncio.to_thread(verified_path, want.sha256, want.size_bytes, self.cache_dir)
        if path is None:
            return
        now = time.monotonic()
        self.tickets = {k: t for k, t in self.tickets.items() if t.expires > now}
        ticket = secrets.token_hex(16)
        self.tickets[ticket] = Ticket(path, want.size_bytes, asker, now + TICKET_S)
        offer = WeightsOffer(device_id=self.device_id, endpoint=self.endpoint, ticket=ticket)
        await msg.respond(offer.model_dump_json().encode())
        log.info("weights offered", extra={"asker": asker, "sha256": want.sha256})

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), IO_WAIT_S)
            ticket, offset, count = _request(line)
            lent = self.tickets.get(ticket)
            if lent is None or lent.expires < time.monotonic():
                raise LendError("no such ticket, or it expired or was used")
            lent.uses -= 1
            if not lent.uses:
                del self.tickets[ticket]
            if not 0 <= offset <= lent.size_bytes:
                raise LendError(f"offset {offset} is outside the file")
            count = lent.size_bytes - offset if count is None else count
            if offset + count > lent.size_bytes:
                raise LendError(f"{count} bytes from {offset} run past the file's end")
            with open(lent.path, "rb") as file:
                if file.seek(0, 2) != lent.size_bytes:
                    raise LendError("the file changed since it was verified")
                writer.write(f"OK {count}\n".encode())
                await writer.drain()
                await asyncio.to_thread(_send, writer, file, offset, count)
            self.lent += 1
            self.sent += count
            log.info("weights lent", extra={"asker": lent.asker, "offset": offset, "bytes": count})
        except LendError as exc:
            writer.write(f"ERR {exc}\n".encode())
        except (TimeoutError, OSError, ValueError) as exc:
            log.info("a weights connection ended early: %s", exc)
        finally:
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _send(writer: asyncio.StreamWriter, file: BinaryIO, offset: int, count: int) -> None:
    """``count`` bytes of ``file`` from ``offset`` to the connection, by the kernel: a
    blocking ``sendfile`` on a duplicate of the socket, on a thread, so the worker's event
    loop stays with its own work while a gigabyte goes out."""
    fd = os.dup(writer.get_extra_info("socket").fileno())
    with socket.socket(fileno=fd) as sock:
        sock.settimeout(IO_WAIT_S)
        sock.sendfile(file, offset, count)


class LendError(RuntimeError):
    """A lender's refusal, sent to the connection."""


def _request(line: bytes) -> tuple[str, int, int | None]:
    parts = line.decode("ascii", "replace").split()
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts[1:]):
        raise LendError("expected '<ticket> <offset> [<bytes>]'")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None


async def ask(nc: NatsClient, device_id: str, sha256: str, size_bytes: int) -> list[WeightsOffer]:
    """The offers holders answered to this device's want by the time the first came (waited
    for up to ``ASK_WAIT_S``; none when no device lends the file)."""
    offers: list[WeightsOffer] = []
    first = asyncio.Event()

    async def on_offer(msg: Msg) -> None:
        with contextlib.suppress(ValidationError):
            offers.append(WeightsOffer.model_validate_json(msg.data))
            first.set()

    sub = await nc.subscribe(nc.new_inbox(), cb=on_offer)
    try:
        want = WeightsWant(device_id=device_id, sha256=sha256, size_bytes=size_bytes)
        await nc.publish(
            WEIGHTS_WANT.subject(device_id=device_id),
            want.model_dump_json().encode(),
            reply=sub.subject,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first.wait(), ASK_WAIT_S)
        await asyncio.sleep(0)  # offers that came with the first
    finally:
        await sub.unsubscribe()
    return list(offers)
