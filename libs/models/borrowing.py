"""A model's file received from a device that lends it (``libs/models/lending.py`` is the lender
and the wire): the asker's half.

Two ways, by what the asker can check the bytes against:

- **Striped**, where the object store holds the model's index (each 512 KiB chunk's sha256,
  ``ranges.publish_index``; ``tessera models add`` puts one there): the file comes over
  ``streams`` connections at once (``default_streams``), each a run of whole chunks, and each
  chunk is checked against the index as its last byte arrives, on the thread that received
  it. So as many cores hash as connections run: one core's SHA-256 (0.9–1.5 GB/s on the
  hosts measured) is less than a 10 Gbit/s link carries. The index is read from the store
  (its own digest checked, and it names the card's sha256), never from the lender.
- **Whole**, where there is no index (a file added through the API, never put into the
  store) or one connection is all a host takes (fewer than four cores): the file hashed as it
  arrives against the card's sha256.

Either way each piece is written as soon as it is hashed, while it is still in the CPU's cache,
into ``<sha256>.gguf.part``, with what it holds beside it (``.part.json``) so a cut copy
resumes (a striped one rechecks the chunks it kept), and the part is renamed into place only
once every byte is checked. A lender whose bytes do not match is refused and the part deleted;
the caller then fetches from the object store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from nats.aio.client import Client as NatsClient

from libs.contracts import WeightsOffer
from libs.models.bulk_fetch import BulkFetchError, open_part, resume
from libs.models.lending import IO_WAIT_S, ask
from libs.models.local_files import Card, read_json

log = logging.getLogger(__name__)

#: Bytes the asker receives at most at a time (a buffer that stays in the CPU's cache).
RECV_BYTES = 1 << 20
#: Bytes received between two records of how far a fetch got (and two progress reports).
REPORT_BYTES = 8 << 20
#: Connections a striped fetch opens at most (a lender's ticket takes ``lending.TICKET_USES``).
MAX_STREAMS = 4


def default_streams() -> int:
    """Connections a fetch opens: one per two cores this process may run on, up to
    ``MAX_STREAMS``, so a host with fewer than four takes one (``bench/results/models.md``:
    two stripes ran at 0.85 × a raw copy on a 10 Gbit/s link on four cores where one
    connection ran at 0.57 ×; on the 2-core test VM two stripes swung between 270 and 850
    MB/s, their median below one connection's on the links that matter)."""
    return max(1, min(MAX_STREAMS, len(os.sched_getaffinity(0)) // 2))


class NotTheFile(RuntimeError):
    """A lender sent bytes that are not the model's."""


class LentFile:
    """One connection to a lender, asked for the file's bytes ``[offset, end)``, answered
    ``OK``."""

    def __init__(self, offer: WeightsOffer, offset: int, end: int) -> None:
        host, _, port = offer.endpoint.rpartition(":")
        self.lender, self.offset, self.end = offer.device_id, offset, end
        try:
            self.sock = socket.create_connection((host.strip("[]"), int(port)), IO_WAIT_S)
        except (OSError, ValueError) as exc:
            raise BulkFetchError(f"{self.lender}'s lender at {offer.endpoint}: {exc}") from None
        try:
            self.sock.sendall(f"{offer.ticket} {offset} {end - offset}\n".encode())
            answer = self._line()
        except OSError as exc:
            self.close()
            raise BulkFetchError(f"{self.lender}'s lender: {exc}") from None
        if answer != f"OK {end - offset}":
            self.close()
            raise BulkFetchError(f"{self.lender} did not lend the file: {answer}")

    def _line(self) -> str:
        line = bytearray()
        while not line.endswith(b"\n") and len(line) < 512:
            if not (byte := self.sock.recv(1)):
                break
            line += byte
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


async def borrow(
    nc: NatsClient,
    device_id: str,
    card: Card,
    target: Path,
    progress: Callable[[int, int], None] | None = None,
    index: dict[str, Any] | None = None,
    streams: int | None = None,
) -> bool:
    """The card's file into ``target``, lent by a device that holds it: each offer in turn
    (resuming the part already written), checked as it arrives — chunk by chunk against
    ``index`` over ``streams`` connections (``default_streams()``) where the store's index
    is given and more than one is, else over one, hashed whole — and renamed into place only
    once all of it is checked.
    ``progress(bytes, total)`` runs on the event loop as it goes (an exception it raises cuts
    the fetch; what was written stays, to resume from). False where no device offers it or
    every lent copy failed (the caller fetches from the object store)."""
    offers = await ask(nc, device_id, card.sha256, card.size_bytes)
    part, state_file = target.with_suffix(".gguf.part"), target.with_suffix(".gguf.part.json")
    report = _on_loop(progress, card.size_bytes)
    streams = streams or default_streams()
    chunks = _chunks(index, card.size_bytes) if streams > 1 else None  # one stream: one hash
    for offer in offers:
        try:
            if chunks is not None:
                await _striped(offer, card, chunks, part, state_file, report, streams)
            else:
                await _whole(offer, card, part, state_file, report)
        except BulkFetchError as exc:  # the lender's fault; this host's own errors go up
            log.warning("weights from %s failed: %s", offer.device_id, exc)
            continue
        except NotTheFile as exc:
            log.warning("%s lent a file that is not %s's: refused (%s)", offer.device_id,
                        card.name, exc)  # fmt: skip
            part.unlink(missing_ok=True)
            state_file.unlink(missing_ok=True)
            continue
        part.replace(target)
        state_file.unlink(missing_ok=True)
        log.info("weights received", extra={"lender": offer.device_id, "sha256": card.sha256})
        return True
    return False


async def _whole(
    offer: WeightsOffer, card: Card, part: Path, state_file: Path, report: Callable[[int], None]
) -> None:
    """One connection from where the part ends (a part of any source: its bytes as far as
    they were written), hashed whole against the card's sha256."""
    written = min(int(read_json(state_file).get("bytes", 0)), card.size_bytes)
    done, digest = await asyncio.to_thread(resume, part, written)
    lent = await asyncio.to_thread(LentFile, offer, done, card.size_bytes)
    with open_part(part, done) as file:
        try:
            await asyncio.to_thread(lent.pull, file, digest, state_file, report)
        finally:
            lent.close()  # a pull still running (this task cancelled) stops
    if digest.hexdigest() != card.sha256:
        raise NotTheFile(f"its sha256 is {digest.hexdigest()[:12]}")


class Chunks:
    """A file's chunks as the store's index lists them, which of them the part holds checked,
    and the connections receiving the rest: shared by a striped fetch's threads."""

    def __init__(self, size: int, chunk_bytes: int, digests: list[str]) -> None:
        self.size, self.chunk_bytes, self.digests = size, chunk_bytes, digests
        self.held: set[int] = set()
        self.lock = threading.Lock()
        self.opened: list[LentFile] = []
        self.cut = threading.Event()  #: set at a failure: no share opens another connection

    def open(self, offer: WeightsOffer, first: int, stop: int) -> LentFile:
        """A connection for chunks ``[first, stop)``, unless the fetch was cut."""
        if self.cut.is_set():
            raise BulkFetchError("the fetch was cut")
        lent = LentFile(offer, self.span(first)[0], self.span(stop - 1)[1])
        with self.lock:
            self.opened.append(lent)
        if self.cut.is_set():  # cut while it connected: closed with the rest
            lent.close()
        return lent

    def stop(self) -> None:
        """Cut the fetch: every connection closed, none opened after."""
        self.cut.set()
        with self.lock:
            opened = list(self.opened)
        for lent in opened:
            lent.close()

    def span(self, i: int) -> tuple[int, int]:
        return i * self.chunk_bytes, min((i + 1) * self.chunk_bytes, self.size)

    def held_bytes(self) -> int:
        return sum(end - start for start, end in map(self.span, self.held))


def _chunks(index: dict[str, Any] | None, size: int) -> Chunks | None:
    """The index's chunks where it describes a file of ``size``; None otherwise."""
    if not index or int(index.get("size", -1)) != size:
        return None
    chunk_bytes, digests = int(index.get("chunk_bytes", 0)), index.get("digests")
    if chunk_bytes <= 0 or not isinstance(digests, list) or len(digests) != -(-size // chunk_bytes):
        return None
    return Chunks(size, chunk_bytes, [str(d) for d in digests])


async def _striped(
    offer: WeightsOffer,
    card: Card,
    chunks: Chunks,
    part: Path,
    state_file: Path,
    report: Callable[[int], None],
    streams: int,
) -> None:
    """The chunks the part lacks over up to ``streams`` connections, each a contiguous share of
    them, every chunk checked against the index on the thread that received it."""
    chunks = Chunks(chunks.size, chunks.chunk_bytes, chunks.digests)  # this offer's own
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        kept = [int(i) for i in read_json(state_file).get("chunks", [])]
        chunks.held = await asyncio.to_thread(_recheck, fd, chunks, kept)
        os.ftruncate(fd, chunks.size)  # never to zero first: see bulk_fetch.open_part
        missing = [i for i in range(len(chunks.digests)) if i not in chunks.held]
        if chunks.held:
            log.info("weights fetch resumed", extra={"sha256": card.sha256,
                                                    "bytes": chunks.held_bytes()})  # fmt: skip
        shares = _shares(missing, streams)
        record = _recorder(chunks, offer.device_id, state_file, report)
        await _run_all(chunks, [(offer, chunks, fd, share, record) for share in shares])
        if len(chunks.held) != len(chunks.digests):
            raise BulkFetchError(f"{offer.device_id} lent {len(chunks.held)} chunks of "
                                 f"{len(chunks.digests)}")  # fmt: skip
        await asyncio.to_thread(record, 0, True)
    finally:
        os.close(fd)


def _shares(missing: list[int], streams: int) -> list[list[int]]:
    """``missing`` cut into up to ``streams`` contiguous shares of about equal length."""
    size = -(-len(missing) // max(1, streams)) if missing else 0
    return [missing[k : k + size] for k in range(0, len(missing), size)] if size else []


def _runs(share: list[int]) -> list[tuple[int, int]]:
    """Consecutive chunk numbers as ``(first, last + 1)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in share:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


async def _run_all(chunks: Chunks, jobs: list[tuple[Any, ...]]) -> None:
    """Each share on its own thread. At the first failure (or this task cancelled) the fetch
    is cut, and every thread has ended (none writes the part any more) before this returns."""
    tasks = [asyncio.ensure_future(asyncio.to_thread(_pull_share, *job)) for job in jobs]
    failed: list[BaseException] = []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [exc for task in tasks if task in done and (exc := task.exception())]
    finally:
        if failed or not all(task.done() for task in tasks):
            chunks.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed:  # the first failure's own error (the others' are its cut)
        raise failed[0]


def _pull_share(
    offer: WeightsOffer,
    chunks: Chunks,
    fd: int,
    share: list[int],
    record: Callable[[int], None],
) -> None:
    """One share's runs of chunks, one connection each (blocking: run on a thread): every
    piece hashed and written at its place as it arrives, every chunk checked as it ends."""
    view = memoryview(bytearray(RECV_BYTES))
    for first, stop in _runs(share):
        lent = chunks.open(offer, first, stop)
        try:
            for i in range(first, stop):
                start, end = chunks.span(i)
                digest = hashlib.sha256()
                while lent.offset < end:
                    at = lent.offset
                    got = lent.recv(view, end - at)
                    digest.update(view[:got])
                    _write_at(fd, view[:got], at)
                if digest.hexdigest() != chunks.digests[i]:
                    raise NotTheFile(f"chunk {i} does not match the store's index")
                with chunks.lock:
                    chunks.held.add(i)
                record(end - start)
        finally:
            lent.close()


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _recheck(fd: int, chunks: Chunks, kept: list[int]) -> set[int]:
    """Of the chunks a cut fetch noted as held, those whose bytes on disk still match."""
    good = set()
    for i in kept:
        if not 0 <= i < len(chunks.digests):
            continue
        start, end = chunks.span(i)
        data = os.pread(fd, end - start, start)
        if hashlib.sha256(data).hexdigest() == chunks.digests[i]:
            good.add(i)
    return good


def _recorder(
    chunks: Chunks, lender: str, state_file: Path, report: Callable[[int], None]
) -> Callable[..., None]:
    """``record(bytes)`` for the share threads: every ``REPORT_BYTES`` checked (and once more
    with ``final``), the held chunks go to ``state_file`` and the bytes held to ``report``."""
    since = [0]
    lock = threading.Lock()

    def record(count: int, final: bool = False) -> None:
        with lock:
            since[0] += count
            if since[0] < REPORT_BYTES and not final:
                return
            since[0] = 0
            with chunks.lock:
                held = sorted(chunks.held)
            state_file.write_text(json.dumps({"lender": lender, "chunks": held}))
            report(sum(end - start for start, end in map(chunks.span, held)))

    return record


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
