"""How a striped fetch cuts the work (``libs/weights/stripes.py``): shares are contiguous and
cover every missing chunk once; an index that does not describe the card's file is not used."""

from __future__ import annotations

import pytest

from libs.weights.stripes import chunk_runs, index_chunks, split_shares


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
