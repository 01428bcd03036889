"""Model files lent from host to host: a device that needs a model's file receives it straight
from a device that holds it, over one TCP connection, sent by the kernel (``sendfile``).

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
  one connection to that one file within ``TICKET_S``. A connection that presents no live
  ticket gets ``ERR`` and nothing else.
- **Checking**: what arrives is hashed as it is written, as from the store; a file that does
  not hash to the card's sha256 is thrown away and fetched from the store. A holder can
  therefore deny (the fetch falls back) but never corrupt a model.

What it grants is what the object store already grants a device (``MODEL_READ``: any model's
weights): a revoked device has no NATS user, so it gets no ticket. The bytes travel in the
clear, as they do through a NATS link without TLS; so where the cluster's NATS uses TLS
nothing is lent (``lends``): the weights come from the store, encrypted.

The wire: the asker sends ``<ticket> <offset>\\n``; the lender answers ``OK <bytes>\\n`` and
sends the file from ``offset`` to its end, or ``ERR <reason>\\n``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from libs.contracts import WEIGHTS_WANT, WeightsOffer, WeightsWant
from libs.models.bulk_fetch import BulkFetchError, open_part, resume
from libs.models.local_files import Card, read_json, verified_path

log = logging.getLogger(__name__)

#: Seconds an asker waits for a holder's offer before it goes to the object store.
ASK_WAIT_S = 0.5
#: Seconds a ticket stays good.
TICKET_S = 30.0
#: Seconds a lender waits for a connection's request line, and an asker for any byte.
IO_WAIT_S = 30.0
#: Bytes the asker receives at most at a time (a buffer that stays in the CPU's cache).
RECV_BYTES = 1 << 20
#: Bytes received between two records of how far a fetch got (and two progress reports).
REPORT_BYTES = 8 << 20


def lends(nc: NatsClient) -> bool:
    """Whether devices on this connection's cluster lend files: only where its NATS link is
    not encrypted (a lent file is not): no TLS context given, no ``tls://`` server, and a
    server that does not require TLS."""
    url = nc.connected_url
    info = getattr(nc, "_server_info", None) or {}
    return not (nc.options.get("tls") or (url and url.scheme == "tls") or info.get("tls_required"))


@dataclass(frozen=True)
class Ticket:
    path: Path
    size_bytes: int
    asker: str
    expires: float


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
        self.lent = 0  #: files sent whole

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
            ticket, offset = _request(line)
            lent = self.tickets.pop(ticket, None)
            if lent is None or lent.expires < time.monotonic():
                raise LendError("no such ticket, or it expired or was used")
            if not 0 <= offset <= lent.size_bytes:
                raise LendError(f"offset {offset} is outside the file")
            with open(lent.path, "rb") as file:
                if (file_size := file.seek(0, 2)) != lent.size_bytes:
                    raise LendError("the file changed since it was verified")
                writer.write(f"OK {file_size - offset}\n".encode())
                await writer.drain()
                await asyncio.to_thread(_send, writer, file, offset, file_size - offset)
            self.lent += 1
            log.info("weights lent", extra={"asker": lent.asker, "bytes": file_size - offset})
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


def _request(line: bytes) -> tuple[str, int]:
    parts = line.decode("ascii", "replace").split()
    if len(parts) != 2 or not parts[1].isdigit():
        raise LendError("expected '<ticket> <offset>'")
    return parts[0], int(parts[1])


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


class LentFile:
    """One lent file's connection: asked from ``offset`` on, answered ``OK``."""

    def __init__(self, offer: WeightsOffer, offset: int, size_bytes: int) -> None:
        host, _, port = offer.endpoint.rpartition(":")
        self.lender, self.offset, self.size_bytes = offer.device_id, offset, size_bytes
        try:
            self.sock = socket.create_connection((host.strip("[]"), int(port)), IO_WAIT_S)
        except (OSError, ValueError) as exc:
            raise BulkFetchError(f"{self.lender}'s lender at {offer.endpoint}: {exc}") from None
        try:
            self.sock.sendall(f"{offer.ticket} {offset}\n".encode())
            answer = self._line()
        except OSError as exc:
            self.close()
            raise BulkFetchError(f"{self.lender}'s lender: {exc}") from None
        if answer != f"OK {size_bytes - offset}":
            self.close()
            raise BulkFetchError(f"{self.lender} did not lend the file: {answer}")

    def _line(self) -> str:
        line = bytearray()
        while not line.endswith(b"\n") and len(line) < 512:
            if not (byte := self.sock.recv(1)):
                break
            line += byte
        return line.decode("ascii", "replace").strip()

    def pull(
        self, file: BinaryIO, digest: Any, state_file: Path, report: Callable[[int], None]
    ) -> None:
        """The rest of the file into ``file`` (blocking: run on a thread). Each piece is hashed
        and written as soon as it arrives, while it is still in the CPU's cache (a piece
        handed to another thread is read from memory again: slower on a small host); every
        ``REPORT_BYTES`` and at the end, how far it got goes to ``state_file`` and then to
        ``report``."""
        buf = bytearray(RECV_BYTES)
        view, since = memoryview(buf), 0
        while self.offset < self.size_bytes:
            try:
                got = self.sock.recv_into(view, min(RECV_BYTES, self.size_bytes - self.offset))
            except TimeoutError:
                raise BulkFetchError(f"{self.lender} sent nothing for {IO_WAIT_S:.0f} s") from None
            except OSError as exc:
                raise BulkFetchError(f"{self.lender}'s connection: {exc}") from None
            if not got:
                raise BulkFetchError(f"{self.lender} closed the connection")
            digest.update(view[:got])
            file.write(view[:got])
            self.offset += got
            since += got
            if since >= REPORT_BYTES or self.offset == self.size_bytes:
                file.flush()
                state_file.write_text(json.dumps({"lender": self.lender, "bytes": self.offset}))
                report(self.offset)
                since = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


async def borrow(
    nc: NatsClient,
    device_id: str,
    card: Card,
    target: Path,
    progress: Callable[[int, int], None] | None = None,
) -> bool:
    """The card's file into ``target``, lent by a device that holds it: each offer in turn
    (resuming the part already written), hashed as it arrives and renamed into place only when
    it hashes to the card's sha256. ``progress(bytes, total)`` runs on the event loop as it
    goes (an exception it raises cuts the fetch; what was written stays, to resume from).
    False where no device offers it or every lent copy failed (the caller fetches from the
    object store)."""
    offers = await ask(nc, device_id, card.sha256, card.size_bytes)
    part, state_file = target.with_suffix(".gguf.part"), target.with_suffix(".gguf.part.json")
    report = _on_loop(progress, card.size_bytes)
    for offer in offers:
        # A part of any source: its bytes as far as they were written.
        written = min(int(read_json(state_file).get("bytes", 0)), card.size_bytes)
        done, digest = await asyncio.to_thread(resume, part, written)
        try:
            lent = await asyncio.to_thread(LentFile, offer, done, card.size_bytes)
            with open_part(part, done) as file:
                try:
                    await asyncio.to_thread(lent.pull, file, digest, state_file, report)
                finally:
                    lent.close()  # a pull still running (this task cancelled) stops
        except BulkFetchError as exc:  # the lender's fault; this host's own errors go up
            log.warning("weights from %s failed: %s", offer.device_id, exc)
            continue
        if digest.hexdigest() == card.sha256:
            part.replace(target)
            state_file.unlink(missing_ok=True)
            log.info("weights received", extra={"lender": offer.device_id, "sha256": card.sha256})
            return True
        log.warning("%s lent a file that is not %s's: refused", offer.device_id, card.name)
        part.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
    return False


def _on_loop(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None]:
    """``report(bytes)`` for a thread: runs ``progress(bytes, total)`` on this event loop and
    waits for it (what it raises is raised in the thread)."""
    loop = asyncio.get_running_loop()

    def report(done: int) -> None:
        if progress is None:
            return
        called: concurrent.futures.Future[None] = concurrent.futures.Future()

        def call() -> None:
            try:
                progress(done, total)
            except BaseException as exc:
                called.set_exception(exc)
            else:
                called.set_result(None)

        loop.call_soon_threadsafe(call)
        called.result(timeout=IO_WAIT_S)

    return report
