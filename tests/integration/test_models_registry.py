"""Models as data, on real Redis and NATS: the registry, the scheduler's model routes (what the
gateway's ``/v1/cluster/models`` forwards to) and deploys by name that place a model only on
devices whose engine serves it, with what a deploy told it, or refuse saying why. Workers are
played by ``Workers`` (test_scheduler_phases.py); every model is generated at test time."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis
from typer.testing import CliRunner

from libs.cli.model_commands import models_app
from libs.cluster import runfile
from libs.cluster.servers import NatsServer
from libs.contracts import ModelCard
from libs.contracts.keys import Keys
from libs.models.gguf_info import read_card
from libs.models.registry import ModelError, ModelRegistry, NameTaken
from libs.models.shipped import MODEL_NAME, shipped_card
from libs.runtime.nats_client import ensure_streams
from libs.runtime.procs import free_port
from libs.weights.local_files import verified_path
from libs.weights.object_store import STREAM, stored
from libs.weights.registration import register_shipped
from libs.weights.whole_files import unpublish
from services.scheduler.api import create_api
from services.scheduler.service import Scheduler
from tests.integration.test_scheduler_phases import Setup, Workers, api, setup  # noqa: F401
from tests.made_models import make_gguf
from tests.unit.services.test_scheduler_handlers import seed
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    return make_gguf(folder / "Qwen-Test.Q8_0.gguf", "qwen2", "Q8_0", layers=6, hidden=128)


async def llama_fleet(made: Setup, names: tuple[str, ...], memory_gb: float = 4.0) -> None:
    for name in names:
        await seed(made.redis, Keys(made.uid), made.device(name), memory_gb, 1.0, "llamacpp")


async def test_the_registry_adds_lists_shows_and_removes_and_never_overwrites(
    redis: Redis, uid: str, qwen: Path
) -> None:
    registry = ModelRegistry(redis, uid)
    card = read_card(qwen)
    assert card.name == "qwen-test.q8_0"
    await registry.add(card, engines={"llamacpp"})
    await registry.add(shipped_card())
    assert [c.name for c in await registry.list()] == [card.name, MODEL_NAME]  # by name
    assert await registry.get(card.name) == card
    assert (await registry.by_sha256(card.sha256)) == card
    other = card.model_copy(update={"architecture": "llama", "sha256": "f" * 64})
    with pytest.raises(NameTaken, match="already registered"):
        await registry.add(other)
    assert await registry.get(card.name) == card  # the first card stands
    unknown = card.model_copy(update={"name": "mystery", "architecture": "no-such-arch"})
    with pytest.raises(ModelError, match="llamacpp does not run architecture no-such-arch"):
        await registry.add(unknown, engines={"llamacpp"})
    with pytest.raises(ModelError, match="torch serves only"):
        await registry.add(card.model_copy(update={"name": "other"}), engines={"torch"})
    assert await registry.names() == {MODEL_NAME, card.name}  # nothing half-registered
    assert await registry.remove(card.name) and not await registry.remove(card.name)
    assert await registry.get(card.name) is None
    with pytest.raises(KeyError, match="registered: smollm2"):
        await registry.card(card.name)


async def test_the_shipped_model_is_registered_with_its_weights_in_the_store_once(
    nc: NatsClient, redis: Redis, uid: str
) -> None:
    """As `tessera up` registers SmolLM2 (and the compose stack's `models` service): its file
    goes into the cluster's object store, so a worker on another host can fetch it, once; a
    cluster started again puts it back if the store lost it; a name that is another file's is
    left alone."""
    await ensure_streams(nc)
    sha = shipped_card().sha256
    await unpublish(nc, sha)  # the session's server may hold it from another test
    card = await register_shipped(ModelRegistry(redis, uid), nc)
    assert card == shipped_card() and await stored(nc, sha) is not None
    messages = (await nc.jetstream().stream_info(STREAM)).state.messages
    assert await register_shipped(ModelRegistry(redis, uid), nc) == card
    assert (await nc.jetstream().stream_info(STREAM)).state.messages == messages  # not again
    assert await unpublish(nc, sha)
    await register_shipped(ModelRegistry(redis, uid), nc)  # started again: put back
    assert await stored(nc, sha) is not None

    other = f"{uid}-other"
    taken = card.model_copy(update={"sha256": "e" * 64})
    await ModelRegistry(redis, other).add(taken)
    assert await unpublish(nc, sha)
    assert await register_shipped(ModelRegistry(redis, other), nc) == taken
    assert await stored(nc, sha) is None  # the name is another file's: nothing sent


async def test_models_are_added_by_path_shown_and_refused_with_the_cause(
    setup: Setup,  # noqa: F811
    qwen: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TESSERA_MODEL_DIR", str(tmp_path / "host-cache"))
    await llama_fleet(setup, ("a",))
    await seed(setup.redis, Keys(setup.uid), setup.device("b"), 4.0, 1.0, "torch")
    service = await setup.scheduler()
    async with api(service) as client:
        added = await client.post("/models", json={"source": str(qwen), "name": "qwen"})
        assert added.status_code == 201, added.text
        card = ModelCard.model_validate(added.json())
        assert (card.name, card.architecture, card.layers) == ("qwen", "qwen2", 6)
        # Hashed here: noted in this host's cache, so a worker of this host lends it.
        assert verified_path(card.sha256, card.size_bytes) == qwen.resolve()
        names = [c["name"] for c in (await client.get("/models")).json()]
        assert names == ["qwen", MODEL_NAME]
        shown = (await client.get("/models/qwen")).json()
        assert shown["chat_template"] and shown["deployments"] == []
        # Which of the cluster's engines serve it, and why the other does not.
        assert shown["engines"] == [
            {"engine": "llamacpp", "serves": True, "why_not": None},
            {"engine": "torch", "serves": False, "why_not": f"torch serves only {MODEL_NAME} here"},
        ]
        taken = await client.post("/models", json={"source": str(qwen), "name": "qwen"})
        assert taken.status_code == 409 and "already registered" in taken.json()["detail"]

        text = tmp_path / "readme.gguf"
        text.write_text("not weights\n")
        bad = await client.post("/models", json={"source": str(text), "name": "bad"})
        assert bad.status_code == 400 and "not a GGUF" in bad.json()["detail"]
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(qwen.read_bytes()[:-5000])
        short = await client.post("/models", json={"source": str(cut), "name": "cut"})
        assert short.status_code == 400 and "truncated" in short.json()["detail"]
        wrong = await client.post(
            "/models", json={"source": str(qwen), "name": "wrong", "sha256": "0" * 64}
        )
        assert wrong.status_code == 400 and "corrupt" in wrong.json()["detail"]
        alien = card.model_copy(update={"name": "alien", "architecture": "no-such-arch"})
        refused = await client.post("/models", json={"card": alien.model_dump(mode="json")})
        assert refused.status_code == 400, refused.text
        assert "no engine in the cluster serves alien" in refused.json()["detail"]
        kept = {c["name"] for c in (await client.get("/models")).json()}
        assert kept == {"qwen", MODEL_NAME}  # none of the bad ones, not even in part

        removed = await client.delete("/models/qwen")
        assert removed.status_code == 200, removed.text
        assert removed.json() == {"name": "qwen", "weights": "absent", "same_file": []}
        assert (await client.get("/models/qwen")).status_code == 404
        gone = await client.post("/placements", json={"model": "qwen"})
        assert gone.status_code == 404 and "registered: smollm2" in gone.json()["detail"]


async def test_a_model_goes_only_where_its_engine_serves_it_and_as_told(
    setup: Setup,  # noqa: F811
    qwen: Path,
) -> None:
    await llama_fleet(setup, ("a", "b", "c"))
    await setup.fleet(("t",))  # a torch worker: it runs SmolLM2 only
    workers = Workers(setup.nc, {})
    await workers.start(setup.uid)
    service = await setup.scheduler()
    torch_device, llama = setup.device("t"), [setup.device(n) for n in ("a", "b", "c")]
    async with api(service) as client:
        card = read_card(qwen, name="q")  # `tessera preview FILE.gguf` before it is added
        early = await client.post("/instance/previews", json={"card": card.model_dump(mode="json")})
        assert early.status_code == 200, early.text
        assert (await client.get("/models/q")).status_code == 404  # nothing was registered
        torn = {**card.model_dump(mode="json"), "layer_bytes": [1, 2]}
        refused = await client.post("/instance/previews", json={"card": torn})
        assert refused.status_code == 422 and "2 entries for" in refused.text, refused.text
        assert (await client.post("/models", json={"source": str(qwen), "name": "q"})).is_success
        shown = (await client.get("/instance/previews", params={"model": "q"})).json()
        assert shown and all(torch_device not in o["devices"] for o in shown)
        assert early.json() == shown

        two = await client.post(
            "/placements", json={"model": "q", "shards": 2, "deployment_id": f"{setup.uid}two"}
        )
        assert two.status_code == 201, two.text
        placed = [a["device_id"] for a in two.json()["assignments"]]
        assert len(placed) == 2 and set(placed) <= set(llama)
        await wait_until(lambda: setup.phase(service, "two") == "serving", 10)
        [task, *_] = workers.loads(f"{setup.uid}two")
        assert task.card is not None and task.card.sha256 == read_card(qwen).sha256

        order = [llama[2], llama[0]]
        told = await client.post(
            "/placements",
            json={"model": "q", "devices": order, "deployment_id": f"{setup.uid}told"},
        )
        assert [a["device_id"] for a in told.json()["assignments"]] == order

        cases: list[tuple[dict[str, Any], str]] = [
            ({"shards": 5}, "told 5 shards: only 3 device(s)"),
            ({"devices": [torch_device]}, "torch serves only"),
            ({"devices": ["nowhere"]}, "not available for it: nowhere"),
            ({"devices": order, "shards": 3}, "told 3 shards on 2 devices"),
        ]
        for body, cause in cases:
            refused = await client.post("/placements", json={"model": "q", **body})
            assert refused.status_code == 409, body
            assert cause in refused.json()["detail"], refused.json()
        deployed = (await client.get("/models/q")).json()["deployments"]
        assert deployed == sorted([f"{setup.uid}two", f"{setup.uid}told"])
        assert (await client.delete("/models/q")).status_code == 409  # deployed: kept


async def test_a_model_larger_than_the_whole_fleet_or_served_by_no_engine_is_refused(
    setup: Setup,  # noqa: F811
    qwen: Path,
) -> None:
    await llama_fleet(setup, ("a", "b"), memory_gb=0.02)
    await setup.fleet(("t",))
    service = await setup.scheduler()
    async with api(service) as client:
        assert (await client.post("/models", json={"source": str(qwen), "name": "q"})).is_success
        big = await client.post("/placements", json={"model": "q"})
        assert big.status_code == 409 and "whole fleet has" in big.json()["detail"], big.json()
        assert "join a machine with more memory (`make join" in big.json()["detail"]  # the fix
        assert "left out" in big.json()["detail"] and "torch serves only" in big.json()["detail"]
    assert len(service.book) == 0  # nothing reported as deployed


@contextlib.asynccontextmanager
async def serving(service: Scheduler) -> AsyncIterator[str]:
    """The scheduler's API on a port of this host, as `tessera` reaches it."""
    port = free_port()
    config = uvicorn.Config(create_api(service), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_models_rm_removes_the_weights_from_the_clusters_object_store(
    setup: Setup,  # noqa: F811
    nats_server: NatsServer,
    qwen: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tessera models add` puts the file into the object store and `models rm` (the
    scheduler's DELETE /models/NAME) takes it out, once no other registered name is the same
    file; added again, it is sent again."""
    path, fd = runfile.claim(tmp_path / "cluster.json")  # a running cluster's run file
    runfile.write(fd, {"nats_url": nats_server.url, "pid": os.getpid()})
    monkeypatch.setenv("TESSERA_RUN_FILE", str(path))
    await llama_fleet(setup, ("a",))
    sha = read_card(qwen).sha256
    cli = CliRunner()

    async def tessera(*args: str) -> str:
        done = await asyncio.to_thread(cli.invoke, models_app, [*args, "--scheduler-url", url])
        assert done.exit_code == 0, done.output
        return " ".join(done.output.split())

    try:
        async with serving(await setup.scheduler()) as url:
            for name in ("q1", "q2"):  # one file under two names
                assert f"added {name}" in await tessera("add", str(qwen), "--name", name)
            assert await stored(setup.nc, sha) is not None
            out = await tessera("rm", "q1")
            assert "removed q1" in out and "stay in the cluster: q2 is the same file" in out
            assert await stored(setup.nc, sha) is not None  # q2 still needs it
            out = await tessera("rm", "q2")
            assert "its weights were removed from the cluster" in out, out
            assert await stored(setup.nc, sha) is None
            await tessera("add", str(qwen), "--name", "q3")
            assert await stored(setup.nc, sha) is not None  # sent again
            await tessera("rm", "q3")
    finally:
        runfile.release(path, fd)
