"""Who may write and delete the model weights, on a real nats-server with the cluster's
generated users (libs/cluster/access.py): the compose stack's ``models`` user puts a model into
the object store (its one-shot ``tessera models add-shipped`` registers SmolLM2 so), the
scheduler's ``DELETE /models/NAME`` (the admin API's ``/v1/cluster/models/NAME``) takes it out
once no other registered name is the same file and leaves no chunk behind, and a device or the
gateway that tries to delete it is refused by the server (the permission error asserted, the
object still whole)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis
from typer.testing import CliRunner

from libs.cli.model_commands import models_app
from libs.cluster.access import AccessControl
from libs.cluster.jetstream_grants import MODEL_STREAM
from libs.cluster.servers import NatsServer
from libs.contracts import SHARD_TASK
from libs.contracts.channels import MODEL_BUCKET
from libs.models.gguf_info import read_card
from libs.models.shipped import MODEL_NAME, shipped_card
from libs.runtime.nats_client import connect_nats, ensure_streams
from libs.weights.object_store import stored
from libs.weights.whole_files import publish, unpublish
from tests.integration.test_models_registry import serving
from tests.integration.test_scheduler_phases import Setup, api
from tests.made_models import make_gguf
from tests.nats_users import Connection

ACCESS = AccessControl(["dev-a"])
CHUNKS = f"$O.{MODEL_BUCKET}.C.>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = ACCESS.write_nats_config(Path(tmp_path_factory.mktemp("nats")) / "nats.conf")
    with NatsServer(config=config) as running:
        yield running  # type: ignore[misc]


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await connect_nats(ACCESS.nats_url(server.url, "admin"), "admin")
    await ensure_streams(nc)
    yield nc
    await nc.close()


async def chunks_left(admin: NatsClient) -> int:
    info = await admin.jetstream().stream_info(MODEL_STREAM, subjects_filter=CHUNKS)
    return sum((info.state.subjects or {}).values())


async def test_the_api_delete_removes_the_weights_and_no_device_or_gateway_can(
    server: NatsServer, admin: NatsClient, redis: Redis, uid: str, tmp_path: Path
) -> None:
    path = make_gguf(tmp_path / "Qwen-Grants.Q8_0.gguf", "qwen2", "Q8_0", layers=2, hidden=64)
    sha = read_card(path).sha256
    writer = Connection(ACCESS)
    assert await publish(await writer.open(server, "models"), path, sha)  # the compose one-shot
    assert await stored(admin, sha) is not None and writer.errors == []
    await writer.nc.close()

    scheduler = Connection(ACCESS)
    made = Setup(await scheduler.open(server, "scheduler"), redis, uid)
    service = await made.scheduler()
    try:
        async with api(service) as client:
            for name in ("g1", "g2"):  # one file under two names
                added = await client.post("/models", json={"source": str(path), "name": name})
                assert added.status_code == 201, added.text
            kept = await client.delete("/models/g1")
            assert kept.json() == {"name": "g1", "weights": "kept", "same_file": ["g2"]}
            assert await stored(admin, sha) is not None  # g2 still needs it

            for who, first in (("dev-a", f"$O.{MODEL_BUCKET}.M."), ("gateway", "$JS.API")):
                intruder = Connection(ACCESS)
                nc = await intruder.open(server, who)
                with pytest.raises(Exception):  # noqa: B017 - the refusal is asserted below
                    await unpublish(nc.jetstream(timeout=1), sha)
                await intruder.refused(first, prefix=True)
                await nc.close()
            assert await stored(admin, sha) is not None and await chunks_left(admin) > 0

            # The scheduler marks objects deleted; it never writes a chunk of weights.
            with pytest.raises(Exception):  # noqa: B017 - the refusal is asserted below
                await scheduler.nc.jetstream(timeout=1).publish(f"$O.{MODEL_BUCKET}.C.x", b"x")
            await scheduler.refused(f"$O.{MODEL_BUCKET}.C.x")

            removed = await client.delete("/models/g2")
            assert removed.json() == {"name": "g2", "weights": "removed", "same_file": []}
            assert await stored(admin, sha) is None and await chunks_left(admin) == 0
            again = await client.delete("/models/g2")
            assert again.status_code == 404
    finally:
        await service.abandon()
        await scheduler.nc.close()


async def test_the_models_user_writes_the_model_store_and_nothing_else(
    server: NatsServer, admin: NatsClient
) -> None:
    writer = Connection(ACCESS)
    nc = await writer.open(server, "models")
    await nc.publish(SHARD_TASK.subject(device_id="dev-a"), b"{}")
    await writer.refused(SHARD_TASK.subject(device_id="dev-a"))
    with pytest.raises(Exception):  # noqa: B017 - the refusal is asserted below
        await nc.jetstream(timeout=1).delete_stream(MODEL_STREAM)
    await writer.refused(f"$JS.API.STREAM.DELETE.{MODEL_STREAM}")
    await nc.close()


async def test_the_compose_one_shot_registers_smollm2_as_models_add_would(
    server: NatsServer, admin: NatsClient, redis: Redis, uid: str
) -> None:
    """`tessera models add-shipped` as the `models` user: the file into the object store, the
    card through the scheduler's API; run again (compose restarts it on failure), nothing."""
    sha = shipped_card().sha256
    scheduler = Connection(ACCESS)
    service = await Setup(await scheduler.open(server, "scheduler"), redis, uid).scheduler()
    cli = CliRunner()
    try:
        async with serving(service) as url:
            async with api(service) as client:  # Setup registered it: start as compose does
                assert (await client.delete(f"/models/{MODEL_NAME}")).status_code == 200
            models_url = ACCESS.nats_url(server.url, "models")
            args = ["add-shipped", "--nats-url", models_url, "--scheduler-url", url]
            done = await asyncio.to_thread(cli.invoke, models_app, args)
            assert done.exit_code == 0 and f"added {MODEL_NAME}" in done.output, done.output
            assert await service.registry.get(MODEL_NAME) == shipped_card()
            assert await stored(admin, sha) is not None
            sent = await chunks_left(admin)
            done = await asyncio.to_thread(cli.invoke, models_app, args)
            assert done.exit_code == 0 and "registered already" in done.output, done.output
            assert await chunks_left(admin) == sent  # not sent again
    finally:
        await service.abandon()
        await scheduler.nc.close()
