"""The bulk of a weights fetch: an object's chunks by JetStream direct get, read off the socket
by a lean reader of NATS replies, hashed and written on a thread of their own.

nats-py's receive path (its parser, a ``Msg`` and a queue hop per message, payloads copied)
tops out near 540 MB/s on one core; weights delivery wants the link's rate. So the chunks come
over a second connection to the same server, as the same user: the CONNECT line is the worker
connection's own (its user and password, token or signed nonce), over TLS when the worker's
connection uses it, so the server grants it exactly what it grants the worker (``MODEL_READ``:
direct get, replies on the user's own inbox) and no port or right is added. It speaks just what
the transfer needs of the NATS client protocol: INFO, CONNECT, SUB to an inbox, PUB of the
direct-get requests, HMSG replies (a chunk's bytes received straight into a buffer of its
own), PING/PONG and -ERR. Everything else stays with nats-py.

Two threads share the work: the reader (socket to chunks) and the writer (sha256 and the
``.part`` file; how far it got is written beside it after each group of chunks). Both spend
their time in calls that release the GIL (``recv_into``, ``hashlib``, ``write``), so on two
cores receiving and hashing overlap. ``progress`` runs on the event loop after each group is
written: an exception it raises cuts the fetch (what is written stays, to resume from).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import queue
import re
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from nats.aio.client import Client as NatsClient

from libs.runtime.nats_private import connect_options

#: Chunks asked of the stream per direct get (32 MiB of 512 KiB chunks: under nats-server's
#: 64 MB of pending bytes per client, past which it would call the reader a slow consumer).
BATCH = 64
#: Chunks received and waiting for the writer.
QUEUED = 32
#: Chunks written (and their progress recorded) at a time at most.
WRITE_CHUNKS = 4
#: Bytes the reader reads ahead for control lines and headers.
READ_AHEAD = 1 << 20

_SEQUENCE = re.compile(rb"\r\nNats-Sequence:\s*(\d+)", re.IGNORECASE)


class BulkFetchError(RuntimeError):
    """The stream stopped answering, refused, or answered what is not a chunk."""


class DirectGetReader:
    """A NATS connection, as ``nc``'s user, that asks a stream for messages by direct get and
    reads the replies (blocking: it runs on a thread)."""

    def __init__(self, nc: NatsClient, stream: str, timeout_s: float) -> None:
        url = nc.connected_url
        if url is None or url.hostname is None:
            raise BulkFetchError("the NATS connection is not connected")
        self.timeout_s = timeout_s
        self.inbox = nc.new_inbox()
        self.api = f"$JS.API.DIRECT.GET.{stream}"
        self.buf = bytearray(READ_AHEAD)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        tls: ssl.SSLContext | None = nc.options.get("tls")
        hostname = nc.options.get("tls_hostname") or url.hostname
        self.sock: Any = socket.create_connection((url.hostname, url.port or 4222), timeout_s)
        try:
            if tls is not None and nc.options.get("tls_handshake_first"):
                self.sock = tls.wrap_socket(self.sock, server_hostname=hostname)
            info = json.loads(self._line().partition(b" ")[2])
            if info.get("tls_required") and not isinstance(self.sock, ssl.SSLSocket):
                if tls is None:
                    raise BulkFetchError("the NATS server requires TLS; the connection has none")
                self.sock = tls.wrap_socket(self.sock, server_hostname=hostname)
            self.sock.sendall(_connect_line(nc, info) + f"SUB {self.inbox} 1\r\nPING\r\n".encode())
            while (line := self._line()) != b"PONG":
                self._control(line)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def ask(self, subject: str, seq: int, batch: int) -> None:
        """Ask for up to ``batch`` messages of ``subject`` from stream sequence ``seq`` on."""
        body = json.dumps({"seq": seq, "next_by_subj": subject, "batch": batch}).encode()
        head = f"PUB {self.api} {self.inbox} {len(body)}\r\n".encode()
        self.sock.sendall(head + body + b"\r\n")

    def next(self) -> tuple[int, bytearray] | None:
        """The next message asked for: (its stream sequence, its bytes); None at the end of a
        batch."""
        while not (line := self._line()).startswith(b"HMSG "):
            self._control(line)
        *_, head_len, total_len = line.split()
        head = bytes(self._exactly(int(head_len)))
        data = self._exactly(int(total_len) - int(head_len))
        if bytes(self._exactly(2)) != b"\r\n":
            raise BulkFetchError("a NATS message did not end where its length said")
        status = head.partition(b"\r\n")[0][len(b"NATS/1.0") :].strip()
        if status.startswith(b"204"):  # the batch's end
            return None
        found = _SEQUENCE.search(head)
        if status or found is None:
            said = status.decode(errors="replace") or "a message without a sequence"
            raise BulkFetchError(f"the stream answered {said}")
        return int(found.group(1)), data

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self.sock.sendall(b"PONG\r\n")
        elif line.startswith(b"-ERR"):
            raise BulkFetchError(f"NATS refused: {line[5:].decode(errors='replace')}")
        # INFO (a cluster's servers changed), +OK, PONG: nothing to do

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            kept = self.end - self.start
            self.buf[:kept] = self.buf[self.start : self.end]
            self.start, self.end = 0, kept
        try:
            got = self.sock.recv_into(self.view[self.end :])
        except TimeoutError:
            raise BulkFetchError(f"NATS sent nothing for {self.timeout_s:.0f} s") from None
        if not got:
            raise BulkFetchError("NATS closed the connection")
        self.end += got

    def _line(self) -> bytes:
        while (at := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            if self.end - self.start >= len(self.buf):
                raise BulkFetchError("a NATS control line longer than the read-ahead")
            self._fill()
        line = bytes(self.view[self.start : at])
        self.start = at + 2
        return line

    def _exactly(self, size: int) -> bytearray:
        """The next ``size`` bytes, in a buffer of their own: what was read ahead, the rest
        received into it directly."""
        out = bytearray(size)
        view = memoryview(out)
        have = min(size, self.end - self.start)
        view[:have] = self.view[self.start : self.start + have]
        self.start += have
        try:
            while have < size:
                got = self.sock.recv_into(view[have:])
                if not got:
                    raise BulkFetchError("NATS closed the connection")
                have += got
        except TimeoutError:
            raise BulkFetchError(f"NATS sent nothing for {self.timeout_s:.0f} s") from None
        return out


def _connect_line(nc: NatsClient, info: dict[str, Any]) -> bytes:
    """The CONNECT that ``nc`` sends (its credentials, whatever their kind), signing this
    connection's nonce where it signs one."""
    options = connect_options(nc, info.get("nonce"))
    options.update(verbose=False, pedantic=False, echo=False, headers=True, no_responders=True)
    options["name"] = f"{options.get('name') or 'tessera'}-weights"
    return b"CONNECT " + json.dumps(options).encode() + b"\r\n"


async def receive(
    nc: NatsClient,
    stream: str,
    subject: str,
    start_seq: int,
    file: BinaryIO,
    digest: Any,
    done: int,
    total: int,
    state_file: Path,
    state: dict[str, Any],
    progress: Callable[[int, int], None] | None,
    timeout_s: float,
) -> int:
    """The messages of ``subject`` from stream sequence ``start_seq`` on, ``total`` bytes in
    all (``done`` of them in ``file`` already), appended to ``file`` and ``digest`` in order;
    after each group written, ``state`` with ``bytes`` and ``seq`` (the last message's stream
    sequence) goes to ``state_file``, then ``progress(bytes written, total)`` runs on the event
    loop before the next group is written (an exception it raises cuts the fetch there).
    Returns the bytes written."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[int | BaseException | None] = asyncio.Queue()
    chunks: queue.Queue[tuple[int, bytearray] | None] = queue.Queue(QUEUED)
    stop = threading.Event()
    acked = threading.Event()  # the loop has called progress with the last group written
    written = done

    def tell(event: int | BaseException | None) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    def put(item: tuple[int, bytearray] | None) -> None:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                return chunks.put(item, timeout=0.1)

    def read(reader: DirectGetReader) -> None:
        got, seq = done, start_seq
        while got < total and not stop.is_set():
            reader.ask(subject, seq, BATCH)
            while (message := reader.next()) is not None:
                got += len(message[1])
                if got > total:
                    raise BulkFetchError(f"the object is longer than its {total} bytes")
                seq = message[0] + 1
                put(message)
        put(None)

    def take() -> tuple[int, bytearray] | None:
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                return chunks.get(timeout=0.1)
        return None

    def write() -> None:
        nonlocal written
        end = False
        while not end and not stop.is_set():
            group = [take()]
            while len(group) < WRITE_CHUNKS and not chunks.empty():
                group.append(chunks.get_nowait())
            end = group[-1] is None
            messages = [item for item in group if item is not None]
            for _, data in messages:
                digest.update(data)
                file.write(data)
                written += len(data)
            if messages:
                file.flush()
                state.update(bytes=written, seq=messages[-1][0])
                state_file.write_text(json.dumps(state))
                if progress is not None:  # nothing more is written until progress returned
                    tell(written)
                    acked.wait()
                    acked.clear()

    def run(work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:
            stop.set()
            tell(exc)
        else:
            tell(None)

    reader = await asyncio.to_thread(DirectGetReader, nc, stream, timeout_s)
    threads = [
        threading.Thread(target=run, args=(lambda: read(reader),), daemon=True),
        threading.Thread(target=run, args=(write,), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        finished = 0
        while finished < len(threads):
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            if event is None:
                finished += 1
            elif progress is not None:
                progress(event, total)
                acked.set()
    finally:
        stop.set()
        acked.set()
        reader.close()  # a read waiting on the socket returns
        for thread in threads:
            await asyncio.to_thread(thread.join)
    return written


def resume(part: Path, done: int) -> tuple[int, Any]:
    """Where a fetch cut short goes on: ``done`` and a sha256 fed the first ``done`` bytes of
    ``part``; (0, a fresh sha256) where the part is missing or shorter than that."""
    digest = hashlib.sha256()
    if not done or not part.exists():
        return 0, digest
    with open(part, "rb") as file:
        left = done
        while left > 0 and (piece := file.read(min(READ_AHEAD, left))):
            digest.update(piece)
            left -= len(piece)
    return (0, hashlib.sha256()) if left else (done, digest)


def open_part(part: Path, done: int) -> BinaryIO:
    """``part`` to write on from byte ``done``: the bytes before it kept, the rest cut off. A
    part begun afresh is a new file, never one truncated to zero: ext4 writes a file that was
    truncated to zero out to disk when it is closed (its ``auto_da_alloc``), which costs
    seconds for a gigabyte that would otherwise stay in the page cache."""
    if not done:
        part.unlink(missing_ok=True)
        return open(part, "wb")
    file = open(part, "r+b")  # noqa: SIM115 - the caller closes it
    file.truncate(done)
    file.seek(done)
    return file
