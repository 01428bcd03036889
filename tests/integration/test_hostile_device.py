"""A hostile joined device, with its own real credentials, against a real nats-server with the
cluster's generated users (libs/cluster/access.py): every JetStream, key-value, inbox, token
and hidden-frame right beyond its own work is refused by the server (the permission error it
sends is asserted, not only a silence), and the cluster goes on serving: the streams keep their
messages, another device still takes its tasks, a client's answer is unchanged. The model
weights' object store is readable, never writable."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from libs.cluster.access import AccessControl
from libs.cluster.jetstream_grants import MODEL_STREAM, WORK_STREAM
from libs.cluster.servers import NatsServer
from libs.contracts import HIDDEN, SHARD_TASK, TOKENS, ShardTask, TokenChunk
from libs.contracts.channels import MODEL_BUCKET, work_consumer
from libs.runtime.bus import NatsBus
from libs.runtime.nats_client import connect_nats, ensure_streams
from libs.weights.local_files import cached_path
from libs.weights.whole_files import ensure_local, fetch, publish
from tests.builders import unload_task
from tests.nats_users import REFUSED, Connection
from tests.waiting import wait_until

ACCESS = AccessControl(["dev-a", "dev-b"])
WEIGHTS = bytes(range(256)) * 4096 * 3  # 3 MiB: chunks of 512 KiB, in batches of BATCH
SHA256 = hashlib.sha256(WEIGHTS).hexdigest()


@dataclass(frozen=True)
class Weights:
    """What weights delivery reads of a model card."""

    name: str
    source: str
    sha256: str
    size_bytes: int


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = ACCESS.write_nats_config(Path(tmp_path_factory.mktemp("nats")) / "nats.conf")
    with NatsServer(config=config) as running:
        yield running  # type: ignore[misc]


@pytest.fixture
async def cluster(server: NatsServer, tmp_path: Path) -> AsyncIterator[NatsClient]:
    """The admin's connection, after the scheduler's part: the streams, a key-value bucket
    and the model store, with an object by name and one by digest (as models are added)."""
    admin = await connect_nats(ACCESS.nats_url(server.url, "admin"), "admin")
    await ensure_streams(admin)
    js = admin.jetstream()
    await js.create_key_value(bucket="tessera_leader")
    store = await js.create_object_store(MODEL_BUCKET)
    await store.put("smol.gguf", WEIGHTS)
    (tmp_path / "smol.gguf").write_bytes(WEIGHTS)
    await publish(admin, tmp_path / "smol.gguf", SHA256)  # as `tessera models add` does
    yield admin
    await admin.close()


@pytest.fixture
async def hostile(server: NatsServer, cluster: NatsClient) -> AsyncIterator[Connection]:
    device = Connection(ACCESS)
    await device.open(server, "dev-a")
    yield device
    await device.nc.close()


async def takes_its_tasks(server: NatsServer, admin: NatsClient, device_id: str) -> None:
    """``device_id``'s worker, through its own consumer with its own user, takes a task."""
    nc = await connect_nats(ACCESS.nats_url(server.url, device_id), f"worker-{device_id}")
    got: list[ShardTask] = []

    async def on_task(message: ShardTask, delivery: object) -> None:
        got.append(message)

    bus = NatsBus(nc)
    mine = SHARD_TASK.subject(device_id=device_id)
    sub = await bus.consume(SHARD_TASK, on_task, durable=work_consumer(device_id), subject=mine)
    await NatsBus(admin).publish_durable(SHARD_TASK, unload_task(device_id), device_id=device_id)
    await wait_until(lambda: len(got) == 1, 10)
    await sub.unsubscribe()
    await nc.close()


async def test_a_device_takes_its_own_tasks_and_reads_the_model_store(
    server: NatsServer, cluster: NatsClient, hostile: Connection, tmp_path: Path
) -> None:
    """Its tasks through its consumer, and a model's weights as a worker fetches them
    (``ensure_local``: direct gets, checksummed), cut short and resumed: no right refused."""
    await takes_its_tasks(server, cluster, "dev-a")
    card = Weights("smol", str(tmp_path / "elsewhere.gguf"), SHA256, len(WEIGHTS))
    target = cached_path(SHA256, tmp_path)
    target.parent.mkdir(parents=True)
    seen: list[int] = []

    def cut(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 1:
            raise ConnectionError("cut short")

    with pytest.raises(ConnectionError):
        await fetch(hostile.nc.jetstream(), card, target, cut)
    assert 0 < seen[0] < len(WEIGHTS) and not target.exists()
    again: list[int] = []
    got = await ensure_local(hostile.nc, card, lambda done, _: again.append(done), tmp_path)
    assert got == target and got.read_bytes() == WEIGHTS
    assert again[0] > seen[0] and again[-1] == len(WEIGHTS)  # resumed, not begun again
    assert hostile.errors == []


async def test_no_consumer_on_the_model_store(cluster: NatsClient, hostile: Connection) -> None:
    """No consumer of any kind on the weights' stream: not a push consumer that would pour the
    chunks onto another subject (here another device's frames), not an ordered one, not a
    named one, not a pull."""
    js = hostile.nc.jetstream(timeout=1)
    api = f"$JS.API.CONSUMER.CREATE.{MODEL_STREAM}"
    elsewhere = HIDDEN.subject(deployment_id="dep-1", device_id="dev-b", sender_id="dev-c")
    push = ConsumerConfig(deliver_subject=elsewhere, ack_policy=AckPolicy.NONE)
    await hostile.refused(api, js.add_consumer(MODEL_STREAM, push))
    chunks = f"$O.{MODEL_BUCKET}.C.>"
    named = ConsumerConfig(name="reader", filter_subject=chunks, ack_policy=AckPolicy.NONE)
    await hostile.refused(f"{api}.reader.{chunks}", js.add_consumer(MODEL_STREAM, named))
    hostile.errors.clear()
    await hostile.refused(api, js.subscribe(chunks, stream=MODEL_STREAM, ordered_consumer=True))
    hostile.errors.clear()
    with pytest.raises(Exception):  # noqa: B017 - refused: asserted below
        await js.pull_subscribe(chunks, stream=MODEL_STREAM)  # named by nats-py
    await wait_until(lambda: any(REFUSED in e and api.lower() in e for e in hostile.errors), 10)
    assert (await cluster.jetstream().stream_info(MODEL_STREAM)).state.consumer_count == 0


async def test_streams_cannot_be_listed_read_purged_or_deleted(
    server: NatsServer, cluster: NatsClient, hostile: Connection
) -> None:
    js = hostile.nc.jetstream(timeout=1)
    api = "$JS.API.STREAM"
    await hostile.refused(f"{api}.LIST", js.streams_info())
    await hostile.refused(f"{api}.NAMES", js.find_stream_name_by_subject(SHARD_TASK.wildcard))
    await hostile.refused(f"{api}.INFO.{WORK_STREAM}", js.stream_info(WORK_STREAM))
    await hostile.refused(f"{api}.MSG.GET.{WORK_STREAM}", js.get_msg(WORK_STREAM, seq=1))
    await hostile.refused(f"{api}.PURGE.{WORK_STREAM}", js.purge_stream(WORK_STREAM))
    await hostile.refused(f"{api}.DELETE.{WORK_STREAM}", js.delete_stream(WORK_STREAM))
    await hostile.refused(f"{api}.DELETE.{MODEL_STREAM}", js.delete_stream(MODEL_STREAM))
    await hostile.refused(
        f"{api}.CREATE.EVIL", js.add_stream(name="EVIL", subjects=[SHARD_TASK.wildcard + "x"])
    )
    info = await cluster.jetstream().stream_info(WORK_STREAM)
    assert info.state.messages >= 1  # nothing was purged or deleted
    await takes_its_tasks(server, cluster, "dev-b")  # and the cluster still serves


async def test_no_consumer_on_another_devices_tasks(
    server: NatsServer, cluster: NatsClient, hostile: Connection
) -> None:
    await takes_its_tasks(server, cluster, "dev-b")  # dev-b's consumer exists
    js = hostile.nc.jetstream(timeout=1)
    api, theirs = "$JS.API.CONSUMER", SHARD_TASK.subject(device_id="dev-b")

    def named(name: str, filtered: str, **more: object) -> ConsumerConfig:
        return ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=filtered,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            **more,  # type: ignore[arg-type]
        )

    other = named(work_consumer("dev-b"), theirs)
    await hostile.refused(
        f"{api}.CREATE.{WORK_STREAM}.worker-dev-b.{theirs}", js.add_consumer(WORK_STREAM, other)
    )
    # Its own consumer's name with another device's tasks: the subject names its own filter,
    # so the server refuses; without the filter in the subject, the old API: refused too.
    mine = named(work_consumer("dev-a"), theirs)
    await hostile.refused(
        f"{api}.CREATE.{WORK_STREAM}.worker-dev-a.{theirs}", js.add_consumer(WORK_STREAM, mine)
    )
    legacy = ConsumerConfig(durable_name="spy", filter_subject=theirs)
    await hostile.refused(
        f"{api}.DURABLE.CREATE.{WORK_STREAM}.spy", js.add_consumer(WORK_STREAM, legacy)
    )
    await hostile.refused(
        f"{api}.CREATE.{WORK_STREAM}",
        js.add_consumer(WORK_STREAM, ConsumerConfig(filter_subject=theirs)),
    )
    await hostile.nc.publish(f"{api}.MSG.NEXT.{WORK_STREAM}.worker-dev-b", b"1")
    await hostile.refused(f"{api}.MSG.NEXT.{WORK_STREAM}.worker-dev-b")
    await hostile.refused(
        f"{api}.DELETE.{WORK_STREAM}.worker-dev-b",
        js.delete_consumer(WORK_STREAM, work_consumer("dev-b")),
    )
    await hostile.refused(
        f"{api}.INFO.{WORK_STREAM}.worker-dev-b",
        js.consumer_info(WORK_STREAM, work_consumer("dev-b")),
    )
    # Its own consumer, as a push consumer that would publish its tasks anywhere: refused by
    # the server (a pull consumer stays one); and acks only on its own consumer.
    await takes_its_tasks(server, cluster, "dev-a")
    push = (await cluster.jetstream().consumer_info(WORK_STREAM, work_consumer("dev-a"))).config
    push.deliver_subject = TOKENS.subject(request_id="someone", device_id="dev-b")
    push.max_waiting = None
    with pytest.raises(nats.js.errors.ServerError, match="pull consumer to push"):
        await js.add_consumer(WORK_STREAM, push)
    ack = f"$JS.ACK.{WORK_STREAM}.worker-dev-b.1.1.1.0.0"
    await hostile.nc.publish(ack, b"+ACK")
    await hostile.refused(ack)
    await takes_its_tasks(server, cluster, "dev-b")


async def test_no_key_value_bucket_is_read_or_written(
    cluster: NatsClient, hostile: Connection
) -> None:
    js = hostile.nc.jetstream(timeout=1)
    await hostile.refused("$JS.API.STREAM.INFO.KV_tessera_leader", js.key_value("tessera_leader"))
    await hostile.nc.publish("$KV.tessera_leader.leader", b"me")
    await hostile.refused("$KV.tessera_leader.leader")
    await hostile.nc.subscribe("$KV.tessera_leader.>")
    await hostile.nc.flush()
    await wait_until(lambda: any("subscription" in e and "$kv" in e for e in hostile.errors), 10)
    kv = await cluster.jetstream().key_value("tessera_leader")
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("leader")


async def test_the_model_store_is_read_only(cluster: NatsClient, hostile: Connection) -> None:
    store = await hostile.nc.jetstream(timeout=1).object_store(MODEL_BUCKET)
    with pytest.raises(Exception):  # noqa: B017 - refused: asserted below
        await store.put("evil.gguf", b"x")
    await wait_until(lambda: any(f"$o.{MODEL_BUCKET.lower()}.c." in e for e in hostile.errors), 10)
    await hostile.refused(f"$JS.API.STREAM.PURGE.{MODEL_STREAM}", store.delete("smol.gguf"))
    kept = await cluster.jetstream().object_store(MODEL_BUCKET)
    assert (await kept.get("smol.gguf")).data == WEIGHTS


async def test_no_other_clients_inbox(server: NatsServer, hostile: Connection) -> None:
    for subject in ("_INBOX.>", "_INBOX_gateway.>", "_INBOX_dev-b.>", ">"):
        await hostile.nc.subscribe(subject)
    await hostile.nc.flush()
    for subject in ("_inbox.>", "_inbox_gateway.>", "_inbox_dev-b.>"):
        await wait_until(
            lambda s=subject: any("subscription" in e and s in e for e in hostile.errors), 10
        )


async def test_no_token_chunk_or_frame_in_another_devices_name(hostile: Connection) -> None:
    chunk = TokenChunk(request_id="r1", index=0, token_id=666, text="pwned", ts=time.time())
    theirs = TOKENS.subject(request_id="r1", device_id="dev-b")
    await hostile.nc.publish(theirs, TOKENS.encode(chunk))
    await hostile.refused(theirs)
    frame = HIDDEN.subject(deployment_id="dep-1", device_id="dev-b", sender_id="dev-b")
    await hostile.nc.publish(frame, b"\0")
    await hostile.refused(frame)


def test_a_device_has_no_redis_user() -> None:
    """Devices never talk to Redis: none of them is among its users (tests/integration/
    test_access.py shows Redis refuses anyone who is not)."""
    users = {rule.split()[0] for rule in ACCESS.redis_acl()}
    assert {"scorer", "gateway"} <= users and not users & {"dev-a", "dev-b", "telemetry"}
