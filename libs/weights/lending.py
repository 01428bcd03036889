"""Model files lent from host to host: a device that needs a model's file receives it straight
from a device that holds it, over TCP connections, sent by the kernel (``sendfile``). This is
the lender and the wire (``Lender``, ``ask``, ``LentFile``); ``libs/weights/borrowing.py``
receives and checks a file, over one connection or in stripes (``libs/weights/stripes.py``).

The object store (``libs/weights/object_store.py``) carries every chunk through nats-server,
which on a small host costs about a CPU-second per gigabyte and shares the cores with the
receiver's hashing and writing; a device holding the file sends it with the kernel's ``sendfile``,
nothing in between (docs/models.md has both measured against a raw copy). The object store
stays the fallback: where no device lends the file, or a lent copy fails, the fetch goes on
from the store.

- **Asking** (``ask``, from ``borrowing.borrow``): the device publishes a ``WeightsWant`` on
  ``WEIGHTS_WANT`` — a subject naming the asker, which only the asker's NATS user may publish to
  — and takes the first ``WeightsOffer`` a holder answers within ``ASK_WAIT_S``, on the asker's
  own inbox (nobody else reads it).
- **Lending** (``Lender``, run by each worker): it answers a want only for a file this host
  knows hashes to the model's sha256 (``local_files.verified_path``: the file a ``models add``
  hashed here, or one a worker loaded or fetched), never for a path a request names. The offer
  carries its address and a ticket: 128 random bits, sent to the asker's inbox alone, good for
  ``TICKET_USES`` connections to that one file (an asker receives the file in several stripes
  at once), each opened within ``TICKET_S`` of the offer or of the end of the ticket's last
  connection. A connection that presents no live ticket gets ``ERR`` and
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
from libs.runtime.nats_private import server_info
from libs.weights.bulk_fetch import BulkFetchError
from libs.weights.local_files import verified_path

log = logging.getLogger(__name__)

#: Seconds an asker waits for a holder's offer before it goes to the object store.
ASK_WAIT_S = 0.5
#: Seconds a ticket stays good.
TICKET_S = 30.0
#: Bytes the asker receives at most at a time (a buffer that stays in the CPU's cache).
RECV_BYTES = 1 << 20
#: Bytes received between two records of how far a fetch got (and two progress reports).
REPORT_BYTES = 8 << 20
#: Threads a lender sends files on at once (more connections wait their turn).
SENDERS = 8
#: Connections a ticket opens at most: the stripes of one fetch (``borrowing.MAX_STREAMS``),
#: each as up to four runs when a resumed fetch lacks several (``stripes.RUNS_PER_SHARE``).
TICKET_USES = 16
#: Seconds a lender waits for a connection's request line, and an asker for any byte.
IO_WAIT_S = 30.0


def lends(nc: NatsClient) -> bool:
    """Whether devices on this connection's cluster lend files: only where its NATS link is
    not encrypted (a lent file is not): no TLS context given, no ``tls://`` server, and a
    server that does not require TLS."""
    url = nc.connected_url
    info = server_info(nc)
    return not (nc.options.get("tls") or (url and url.scheme == "tls") or info.get("tls_required"))


@dataclass
class Ticket:
    path: Path
    size_bytes: int
    asker: str
    expires: float  #: while no connection of it is open
    uses: int = TICKET_USES
    open: int = 0  #: its connections sending now

    def live(self, now: float) -> bool:
        return self.open > 0 or self.expires > now


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
        #: Threads of their own for the sends: a slow asker never holds the event loop's
        #: default executor, which the worker's own work uses.
        self.senders = concurrent.futures.ThreadPoolExecutor(SENDERS, "weights-lend")

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
        self.senders.shutdown(wait=False, cancel_futures=True)

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
        self.tickets = {k: t for k, t in self.tickets.items() if t.live(now)}
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
            if lent is None or not lent.live(time.monotonic()):
                raise LendError("no such ticket, or it expired or was used")
            lent.uses -= 1
            if not lent.uses:
                del self.tickets[ticket]
            await self._send_part(lent, writer, offset, count)
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

    async def _send_part(
        self, lent: Ticket, writer: asyncio.StreamWriter, offset: int, count: int | None
    ) -> None:
        """``count`` bytes from ``offset`` (to the end where None) of the ticket's file. The
        ticket stays good while this runs and ``TICKET_S`` after: a share's next run of chunks
        comes as this one ends."""
        lent.open += 1
        try:
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
                if count:  # sendfile's count 0 would mean "to the end"
                    await asyncio.get_running_loop().run_in_executor(
                        self.senders, _send, writer, file, offset, count
                    )
            self.lent += 1
            self.sent += count
            log.info("weights lent", extra={"asker": lent.asker, "offset": offset, "bytes": count})
        finally:
            lent.open -= 1
            lent.expires = time.monotonic() + TICKET_S


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


class NotTheFile(RuntimeError):
    """A lender sent bytes that are not the model's."""


class LentFile:
    """One connection to a lender, asked for the file's bytes ``[offset, end)``. Made
    unconnected, so whoever cuts a fetch can close it while it connects; ``open`` connects and
    waits for ``OK`` (the whole exchange within ``IO_WAIT_S``)."""

    def __init__(self, offer: WeightsOffer, offset: int, end: int) -> None:
        self.offer, self.lender, self.offset, self.end = offer, offer.device_id, offset, end
        self.sock = socket.socket(_family(offer.endpoint), socket.SOCK_STREAM)

    def open(self) -> LentFile:
        endpoint, count = self.offer.endpoint, self.end - self.offset
        host, _, port = endpoint.rpartition(":")
        deadline = time.monotonic() + IO_WAIT_S
        try:
            self.sock.settimeout(IO_WAIT_S)
            self.sock.connect((host.strip("[]"), int(port)))
            self.sock.sendall(f"{self.offer.ticket} {self.offset} {count}\n".encode())
            answer = self._line(deadline)
        except (OSError, ValueError) as exc:
            self.close()
            raise BulkFetchError(f"{self.lender}'s lender at {endpoint}: {exc}") from None
        if answer != f"OK {count}":
            self.close()
            raise BulkFetchError(f"{self.lender} did not lend the file: {answer}")
        return self

    def _line(self, deadline: float) -> str:
        line = bytearray()
        while not line.endswith(b"\n") and len(line) < 512:
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"no answer within {IO_WAIT_S:.0f} s")
            self.sock.settimeout(left)
            if not (byte := self.sock.recv(1)):
                break
            line += byte
        self.sock.settimeout(IO_WAIT_S)
        return line.decode("ascii", "replace").strip()

    def recv(self, view: memoryview, most: int) -> int:
        """Up to ``most`` bytes into ``view``; the lender's failures as ``BulkFetchError``."""
        try:
            got = self.sock.recv_into(view, min(most, self.end - self.offset))
        except TimeoutError:
            raise BulkFetchError(f"{self.lender} sent nothing for {IO_WAIT_S:.0f} s") from None
        except OSError as exc:
            raise BulkFetchError(f"{self.lender}'s connection: {exc}") from None
        if not got:
            raise BulkFetchError(f"{self.lender} closed the connection")
        self.offset += got
        return got

    def pull(
        self, file: BinaryIO, digest: Any, state_file: Path, report: Callable[[int], None]
    ) -> None:
        """The rest of the file into ``file``, each piece hashed into ``digest`` and written as
        it arrives (blocking: run on a thread); every ``REPORT_BYTES`` and at the end, how far
        it got goes to ``state_file`` and then to ``report``."""
        view, since = memoryview(bytearray(RECV_BYTES)), 0
        while self.offset < self.end:
            got = self.recv(view, RECV_BYTES)
            digest.update(view[:got])
            file.write(view[:got])
            since += got
            if since >= REPORT_BYTES or self.offset == self.end:
                file.flush()
                state_file.write_text(json.dumps({"lender": self.lender, "bytes": self.offset}))
                report(self.offset)
                since = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def _family(endpoint: str) -> socket.AddressFamily:
    return socket.AF_INET6 if endpoint.startswith("[") else socket.AF_INET
