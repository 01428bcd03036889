"""A torch shard fetches only its layer range from the cluster's object store, against a real
nats-server with the cluster's users: the shipped GGUF put once by the admin, each of a 2-shard
placement's devices receives measurably fewer bytes than the file, every chunk checked against
the index published with it, and the pipeline of the two sparse copies computes what the
whole file computes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NatsClient

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer
from libs.contracts.models import ModelCard
from libs.models.shipped import gguf_path, shipped_card
from libs.runtime.nats_client import close_nats, connect_nats
from libs.weights import layer_ranges, object_store
from libs.weights.object_store import CHUNK_BYTES, WeightsError
from libs.weights.whole_files import publish
from services.worker.torch.shard import ShardModel

PROMPT = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 198]])


@pytest.fixture(scope="module")
def access(tmp_path_factory: pytest.TempPathFactory) -> AccessControl:
    return AccessControl(["dev-1", "dev-2"])


@pytest.fixture
async def cluster(access: AccessControl, tmp_path: Path) -> AsyncIterator[dict[str, NatsClient]]:
    config = access.write_nats_config(tmp_path / "nats.conf")
    with NatsServer(config=config) as server:
        users = {u: await connect_nats(access.nats_url(server.url, u), u) for u in access_users()}
        try:
            yield users
        finally:
            for nc in users.values():
                await close_nats(nc)


def access_users() -> tuple[str, ...]:
    return ("admin", "dev-1", "dev-2")


def elsewhere() -> ModelCard:
    """The shipped model's card as a host without its file sees it (added on another host)."""
    return shipped_card().model_copy(update={"source": "/not/on/this/host.gguf"})


async def test_each_shard_receives_only_its_layers_and_computes_what_the_whole_does(
    cluster: dict[str, NatsClient], tmp_path: Path
) -> None:
    card = elsewhere()
    await publish(cluster["admin"], gguf_path(), card.sha256)
    half, layers = card.layers // 2, card.layers
    steps: list[tuple[int, int]] = []
    first = await layer_ranges.fetch_layers(
        cluster["dev-1"], card, 0, half, layers, lambda d, t: steps.append((d, t)), tmp_path / "a"
    )
    last = await layer_ranges.fetch_layers(
        cluster["dev-2"], card, half, layers, layers, None, tmp_path / "b"
    )
    size = card.size_bytes
    print(f"file {size} B; received: first {first.received_bytes} B, last {last.received_bytes} B")
    for got in (first, last):
        assert not got.whole and got.path.stat().st_size == size  # sparse: holes where not fetched
        assert 0 < got.received_bytes < 0.75 * size
        assert got.path.stat().st_blocks * 512 < 0.8 * size  # the holes take no disk
    assert steps[-1][0] == steps[-1][1] == first.received_bytes  # progress up to what it needed

    whole = ShardModel(gguf_path(), 0, layers, "float32")
    head = ShardModel(first.path, 0, half, "float32")
    tail = ShardModel(last.path, half, layers, "float32")
    expected = whole.forward(PROMPT, whole.new_cache())
    got_logits = tail.forward(head.forward(PROMPT, head.new_cache()), tail.new_cache())
    assert torch.equal(got_logits, expected)


async def test_a_second_shard_on_the_same_host_fetches_only_what_it_lacks(
    cluster: dict[str, NatsClient], tmp_path: Path
) -> None:
    card = elsewhere()
    await publish(cluster["admin"], gguf_path(), card.sha256)
    half, layers = card.layers // 2, card.layers
    first = await layer_ranges.fetch_layers(cluster["dev-1"], card, 0, half, layers, None, tmp_path)
    again = await layer_ranges.fetch_layers(cluster["dev-1"], card, 0, half, layers, None, tmp_path)
    assert again.received_bytes == 0 and again.path == first.path
    alone = await layer_ranges.fetch_layers(
        cluster["dev-2"], card, half, layers, layers, None, tmp_path / "other-host"
    )
    rest = await layer_ranges.fetch_layers(
        cluster["dev-1"], card, half, layers, layers, None, tmp_path
    )
    # The header and the tied embedding were there already: the last shard's own layers came.
    assert 0 < rest.received_bytes < alone.received_bytes - 10 * CHUNK_BYTES


async def test_a_chunk_that_does_not_match_the_index_is_refused(
    cluster: dict[str, NatsClient], tmp_path: Path
) -> None:
    card = elsewhere()
    admin = cluster["admin"]
    await publish(admin, gguf_path(), card.sha256)
    store = await object_store.bucket(admin.jetstream())
    index = json.loads((await store.get(object_store.index_name(card.sha256))).data or b"{}")
    index["digests"][0] = "00" * 32  # the header's chunk no longer matches
    await store.put(object_store.index_name(card.sha256), json.dumps(index).encode())
    with pytest.raises(WeightsError, match=r"chunk 0 .* does not match its index"):
        await layer_ranges.fetch_layers(cluster["dev-1"], card, 0, 1, card.layers, None, tmp_path)
    held = tmp_path / "gguf" / f"{card.sha256}.sparse.json"
    assert not held.exists() or 0 not in json.loads(held.read_text())["chunks"]


async def test_a_host_that_holds_the_file_fetches_nothing(
    cluster: dict[str, NatsClient], tmp_path: Path
) -> None:
    card = shipped_card()  # its source is this host's own file
    got = await layer_ranges.fetch_layers(None, card, 0, 1, card.layers, None, tmp_path)
    assert got.whole and got.received_bytes == 0 and got.path == gguf_path()
