"""A lent model file received in stripes (``borrowing.borrow`` chooses it): several connections
to the lender at once, each a contiguous share of the file's chunks, each chunk checked against
its SHA-256 in the object store's index of the file as its last byte arrives, on the thread
that received it, and written at its place (``os.pwrite``) into the part file.

So as many cores hash as connections run. The index is read from the store (its own digest
checked, and it names the card's sha256), never from the lender. Beside the part, its state
lists the chunks it holds checked; a cut fetch checks them again from disk (``recheck``) and
asks only for the rest. At the first failure every connection is closed and every thread has
ended before the fetch returns, so nothing writes the part after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.contracts import WeightsOffer
from libs.weights.bulk_fetch import BulkFetchError
from libs.weights.lending import RECV_BYTES, REPORT_BYTES, TICKET_USES, LentFile, NotTheFile
from libs.weights.local_files import Card, read_json

log = logging.getLogger(__name__)

#: Runs of chunks (one connection each) a share asks for at most: the shares of one fetch
#: (``borrowing.MAX_STREAMS``, 4) times this fit the uses of one ticket.
RUNS_PER_SHARE = TICKET_USES // 4


class Chunks:
    """A file's chunks as the store's index lists them, which of them the part holds checked,
    and the connections receiving the rest: shared by a striped fetch's threads."""

    def __init__(
        self, size: int, chunk_bytes: int, digests: list[str], held: set[int] | None = None
    ) -> None:
        self.size, self.chunk_bytes, self.digests = size, chunk_bytes, digests
        self.held: set[int] = set() if held is None else held
        self.lock = threading.Lock()
        self.opened: list[LentFile] = []
        self.cut = threading.Event()  #: set at a failure: no share opens another connection

    def open(self, offer: WeightsOffer, first: int, stop: int) -> LentFile:
        """A connection for chunks ``[first, stop)``, unless the fetch was cut (it is noted
        before it connects, so a cut closes it even then)."""
        lent = LentFile(offer, self.span(first)[0], self.span(stop - 1)[1])
        with self.lock:
            self.opened.append(lent)
        if self.cut.is_set():
            lent.close()
            raise BulkFetchError("the fetch was cut")
        return lent.open()

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


def index_chunks(index: dict[str, Any] | None, size: int) -> Chunks | None:
    """The index's chunks where it describes a file of ``size``; None otherwise."""
    if not index or int(index.get("size", -1)) != size:
        return None
    chunk_bytes, digests = int(index.get("chunk_bytes", 0)), index.get("digests")
    if chunk_bytes <= 0 or not isinstance(digests, list) or len(digests) != -(-size // chunk_bytes):
        return None
    return Chunks(size, chunk_bytes, [str(d) for d in digests])


async def fetch(
    offer: WeightsOffer,
    card: Card,
    chunks: Chunks,
    part: Path,
    state_file: Path,
    report: Callable[[int], None],
    streams: int,
) -> None:
    """The chunks the part lacks (``chunks.held``: checked) over up to ``streams`` connections,
    each a contiguous share of them, every chunk checked against the index on the thread that
    received it."""
    chunks = Chunks(chunks.size, chunks.chunk_bytes, chunks.digests, chunks.held)  # its own cut
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # The state says what the part holds before a byte of this fetch is written: a part
        # another kind of fetch left is never resumed from again.
        _write_state(state_file, offer.device_id, chunks)
        os.ftruncate(fd, chunks.size)  # never to zero first: see bulk_fetch.open_part
        missing = [i for i in range(len(chunks.digests)) if i not in chunks.held]
        if chunks.held:
            log.info("weights fetch resumed", extra={"sha256": card.sha256,
                                                    "bytes": chunks.held_bytes()})  # fmt: skip
        record = _recorder(chunks, offer.device_id, state_file, report)
        jobs = [(offer, chunks, fd, share, record) for share in split_shares(missing, streams)]
        await _run_all(chunks, jobs)
        if len(chunks.held) != len(chunks.digests):
            raise BulkFetchError(f"{offer.device_id} lent {len(chunks.held)} chunks of "
                                 f"{len(chunks.digests)}")  # fmt: skip
        await asyncio.to_thread(record, 0, True)
    finally:
        os.close(fd)


def split_shares(missing: list[int], streams: int) -> list[list[int]]:
    """``missing`` cut into up to ``streams`` contiguous shares of about equal length."""
    size = -(-len(missing) // max(1, streams)) if missing else 0
    return [missing[k : k + size] for k in range(0, len(missing), size)] if size else []


def share_runs(share: list[int], most: int = RUNS_PER_SHARE) -> list[tuple[int, int]]:
    """The runs a share asks for, one connection each: exactly its missing chunks while they
    make at most ``most`` runs (a part cut once lacks one run per stripe); past that the runs
    across the narrowest held gaps merge, and only those held chunks come again."""
    runs = chunk_runs(share)
    while len(runs) > most:
        k = min(range(len(runs) - 1), key=lambda j: runs[j + 1][0] - runs[j][1])
        runs[k : k + 2] = [(runs[k][0], runs[k + 1][1])]
    return runs


def chunk_runs(share: list[int]) -> list[tuple[int, int]]:
    """Consecutive chunk numbers as ``(first, last + 1)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in share:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


async def _run_all(chunks: Chunks, jobs: list[tuple[Any, ...]]) -> None:
    """Each share on its own thread. At the first failure (or this task cancelled, once or
    more) the fetch is cut, and every thread has ended (none writes the part any more) before
    this returns or raises."""
    if not jobs:
        return
    tasks = [asyncio.ensure_future(asyncio.to_thread(_pull_share, *job)) for job in jobs]
    failed: list[BaseException] = []
    cancelled = False
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [exc for task in tasks if task in done and (exc := task.exception())]
    except asyncio.CancelledError:
        cancelled = True
    if failed or cancelled:
        chunks.stop()
    ended = asyncio.gather(*tasks, return_exceptions=True)
    while not ended.done():
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
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
    for first, stop in share_runs(share):
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


def recheck(part: Path, state_file: Path, chunks: Chunks) -> set[int]:
    """Of the chunks a cut striped fetch noted as held (``state_file``), those whose bytes in
    ``part`` still match; none where the part or the note is missing."""
    kept = read_json(state_file).get("chunks", [])
    good: set[int] = set()
    if not kept or not part.exists():
        return good
    with open(part, "rb") as file:
        for i in sorted({int(i) for i in kept if 0 <= int(i) < len(chunks.digests)}):
            start, end = chunks.span(i)
            file.seek(start)
            if hashlib.sha256(file.read(end - start)).hexdigest() == chunks.digests[i]:
                good.add(i)
    return good


def _write_state(state_file: Path, lender: str, chunks: Chunks) -> None:
    with chunks.lock:
        held = sorted(chunks.held)
    state_file.write_text(json.dumps({"lender": lender, "chunks": held}))


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
            _write_state(state_file, lender, chunks)
            report(chunks.held_bytes())

    return record
