"""A model's file received from a device that lends it (``libs/weights/lending.py`` is the lender
and the wire): the asker's half.

Two ways, by what the asker can check the bytes against:

- **Striped**, where the object store holds the model's index (each 512 KiB chunk's sha256,
  ``object_store.publish_index``; ``tessera models add`` puts one there): the file comes over
  ``streams`` connections at once (``default_streams``), each a run of whole chunks, and each
  chunk is checked against the index as its last byte arrives, on the thread that received
  it (``libs/weights/stripes.py``). So as many cores hash as connections run: one core hashes
  0.9–1.5 GB/s (SHA-256, on the hosts measured) and receiving and writing cost about as much
  again, less than a 10 Gbit/s link carries. The index is read from the store (its own digest
  checked, and it names the card's sha256), never from the lender.
- **Whole**, where there is no index (a file added through the API, never put into the
  store) or one connection is all a host takes (fewer than four cores): the file hashed as it
  arrives against the card's sha256.

Either way each piece is written as soon as it is hashed, while it is still in the CPU's cache,
into ``<sha256>.gguf.part``, with what it holds beside it (``.part.json``), so a cut copy
resumes: a striped one from the chunks it kept, checked again; one connection from the part's
end, whatever wrote it, the bytes there hashed again. The part is renamed into place only once
every byte is checked. A lender whose bytes do not match is refused and the part deleted; the
caller then fetches from the object store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from libs.contracts import WeightsOffer
from libs.weights import stripes
from libs.weights.bulk_fetch import BulkFetchError, open_part, resume
from libs.weights.lending import IO_WAIT_S, LentFile, NotTheFile, ask
from libs.weights.local_files import Card, read_json

log = logging.getLogger(__name__)

#: Connections a striped fetch opens at most (a lender's ticket takes ``lending.TICKET_USES``).
MAX_STREAMS = 4


def default_streams() -> int:
    """Connections a fetch opens: one per two cores this process may run on, up to
    ``MAX_STREAMS``, so a host with fewer than four takes one (``bench/results/models.md``:
    two stripes ran at 0.85 × a raw copy on a 10 Gbit/s link on four cores where one
    connection ran at 0.57 ×; on the 2-core test VM two stripes swung between 270 and 850
    MB/s, their median below one connection's on the links that matter)."""
    return max(1, min(MAX_STREAMS, len(os.sched_getaffinity(0)) // 2))


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
    part, state_file = target.with_suffix(".gguf.part"), target.with_suffix(".gguf.part.json")
    streams = streams or default_streams()
    # Over one connection the file is hashed whole as it comes; over more, chunk by chunk.
    chunks = stripes.index_chunks(index, card.size_bytes) if streams > 1 else None
    if chunks is not None:  # what a cut striped fetch kept, checked before a ticket is asked
        chunks.held = await asyncio.to_thread(stripes.recheck, part, state_file, chunks)
    offers = await ask(nc, device_id, card.sha256, card.size_bytes)
    report = _on_loop(progress, card.size_bytes)
    for offer in offers:
        try:
            if chunks is not None:
                await stripes.fetch(offer, card, chunks, part, state_file, report, streams)
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
            if chunks is not None:
                chunks.held.clear()
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
    lent = LentFile(offer, done, card.size_bytes)
    try:
        await asyncio.to_thread(lent.open)
    except BaseException:
        lent.close()
        raise
    with open_part(part, done) as file:
        try:
            await asyncio.to_thread(lent.pull, file, digest, state_file, report)
        finally:
            lent.close()  # a pull still running (this task cancelled) stops
    if digest.hexdigest() != card.sha256:
        raise NotTheFile(f"its sha256 is {digest.hexdigest()[:12]}")


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
