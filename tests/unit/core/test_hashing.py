"""Consistent hashing moves about 1/n of the keys on churn; hashing is stable."""

from __future__ import annotations

import pytest

from libs.core.hashing import HashRing, stable_hash

KEYS = [f"user-{i}" for i in range(20_000)]


@pytest.mark.parametrize("n", [5, 10, 20])
def test_adding_a_device_moves_at_most_1_2_over_n_of_the_keys(n: int) -> None:
    nodes = [f"dev-{i}" for i in range(n)]
    before = HashRing(nodes)
    after = HashRing([*nodes, "dev-new"])
    moved = sum(before.lookup(k) != after.lookup(k) for k in KEYS)
    assert 0 < moved / len(KEYS) <= 1.2 / (n + 1)  # the new device took some keys
    # Every moved key went to the new device: nothing shuffles between the old ones.
    assert all(after.lookup(k) == "dev-new" for k in KEYS if before.lookup(k) != after.lookup(k))


def test_removing_a_device_moves_only_its_keys() -> None:
    nodes = [f"dev-{i}" for i in range(10)]
    before, after = HashRing(nodes), HashRing(nodes[1:])
    for key in KEYS[:2000]:
        if before.lookup(key) != "dev-0":
            assert after.lookup(key) == before.lookup(key)


def test_hash_is_stable_across_processes() -> None:
    assert stable_hash("tessera") == 0x12D698870EBBB0C  # blake2b-64, pinned: no PYTHONHASHSEED
    assert HashRing(["a", "b"]).lookup("k") == HashRing(["b", "a"]).lookup("k")


def test_walk_yields_each_device_once() -> None:
    ring = HashRing(["a", "b", "c"], replicas=50)
    assert sorted(ring.walk("key")) == ["a", "b", "c"]
    assert list(HashRing([]).walk("key")) == []
