"""How a striped fetch cuts the work (``libs/weights/stripes.py``): shares are contiguous and
cover every missing chunk once; an index that does not describe the card's file is not used."""

from __future__ import annotations

import itertools

import pytest

from libs.weights.lending import TICKET_USES
from libs.weights.stripes import chunk_runs, index_chunks, share_runs, split_shares


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 7])
def test_shares_cover_each_missing_chunk_once_in_contiguous_runs(streams: int) -> None:
    missing = [*range(0, 10), *range(14, 20), 31]  # a resumed fetch's holes
    shares = split_shares(missing, streams)
    assert len(shares) <= streams
    assert [i for share in shares for i in share] == missing
    assert max(map(len, shares)) - min(map(len, shares)) <= len(missing) // streams + 1
    assert chunk_runs(shares[0] if streams == 1 else missing) == [(0, 10), (14, 20), (31, 32)]


def test_nothing_missing_opens_no_connection() -> None:
    assert split_shares([], 4) == []


def test_an_index_is_used_only_when_it_describes_the_file() -> None:
    index = {"size": 1000, "chunk_bytes": 300, "digests": ["a", "b", "c", "d"]}
    chunks = index_chunks(index, 1000)
    assert chunks is not None and chunks.span(3) == (900, 1000)
    assert index_chunks(index, 1001) is None  # another size
    assert index_chunks({**index, "digests": ["a", "b", "c"]}, 1000) is None  # a chunk short
    assert index_chunks({**index, "chunk_bytes": 0}, 1000) is None
    assert index_chunks(None, 1000) is None


def test_a_resumed_fetch_asks_only_for_the_chunks_it_lacks() -> None:
    """The shape CI met once: 39 chunks fetched in 3 stripes (0-12, 13-25, 26-38), cut, each
    stripe's tail missing: [9..12], [25], [37, 38]. Cut in 3 shares, one share is [12, 25, 37]:
    it was asked for as chunks 12..37, 24 of them already held (15.2 MB sent for 3.2 missing)."""
    missing = [9, 10, 11, 12, 25, 37, 38]
    shares = split_shares(missing, 3)
    assert [12, 25, 37] in shares
    asked = [i for share in shares for first, stop in share_runs(share) for i in range(first, stop)]
    assert asked == missing  # nothing held comes again
    # Every state one cut can leave (a held start per stripe), for 2 to 4 stripes: exactly the
    # missing chunks, within the uses of one ticket.
    for streams in (2, 3, 4):
        stripes = split_shares(list(range(39)), streams)
        for held in _held_starts([len(s) for s in stripes]):
            lacking = [i for s, h in zip(stripes, held, strict=True) for i in s[h:]]
            runs = [r for share in split_shares(lacking, streams) for r in share_runs(share)]
            assert [i for first, stop in runs for i in range(first, stop)] == lacking
            assert len(runs) <= TICKET_USES


def _held_starts(lengths: list[int]) -> list[tuple[int, ...]]:
    """Each way of holding the first ``h`` chunks of every stripe (every third ``h``)."""
    return list(itertools.product(*(range(0, n + 1, 3) for n in lengths)))


def test_scattered_holes_merge_across_the_narrowest_held_gaps_only() -> None:
    share = [0, 2, 3, 10, 20, 21, 30]  # five runs
    assert share_runs(share, most=4) == [(0, 4), (10, 11), (20, 22), (30, 31)]  # chunk 1 again
    assert share_runs(share, most=1) == [(0, 31)]
