"""Access control: a real nats-server and redis-server with the generated users refuse every
publish, subscription and write a service was not granted, and anyone without a password."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import kombu.exceptions
import nats
import pytest
import redis
from nats.aio.client import Client as NatsClient

from libs.cluster.access import AccessControl
from libs.cluster.servers import NatsServer, RedisServer
from libs.contracts import (
    DEPLOYMENT_MEASURED,
    DVFS_HINT,
    PLACEMENT_DECISION,
    PROBE,
    SHARD_TASK,
    TELEMETRY,
)
from libs.contracts.keys import Keys
from tests.waiting import wait_until

ACCESS = AccessControl(["dev-a", "dev-b"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    config = ACCESS.write_nats_config(Path(tmp_path_factory.mktemp("nats")) / "nats.conf")
    with NatsServer(config=config) as running:
        yield running  # type: ignore[misc]


class Client:
    """A connection as one user, keeping the errors the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: NatsClient | None = None

    async def connect(self, server: NatsServer, user: str) -> NatsClient:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            ACCESS.nats_url(server.url, user), allow_reconnect=False, error_cb=on_error
        )
        return self.nc


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await Client().connect(server, "admin")
    yield nc
    await nc.close()


async def heard(admin: NatsClient, subject: str, send: object, within_s: float = 0.5) -> bool:
    """Whether a message published by ``send()`` on ``subject`` reaches a subscriber within
    ``within_s``. A refusal can only be shown by a window passing quietly; where a message
    must arrive, ``within_s`` is generous and ``send()`` repeats every half second: the
    first message right after the server starts went unheard in about 1 run in 12 here
    (cause not found; a repeat a moment later always arrived)."""
    got = asyncio.Event()

    async def on_msg(msg: object) -> None:
        got.set()

    sub = await admin.subscribe(subject, cb=on_msg)
    await admin.flush()
    deadline = asyncio.get_running_loop().time() + within_s
    try:
        while not got.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await send()  # type: ignore[operator]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got.wait(), min(0.5, left))
    finally:
        await sub.unsubscribe()
    return True


async def test_a_device_publishes_only_its_own_telemetry_and_never_placements(
    server: NatsServer, admin: NatsClient
) -> None:
    device = Client()
    nc = await device.connect(server, "dev-a")

    async def publish(subject: str) -> None:
        await nc.publish(subject, b"{}")
        await nc.flush()

    own = TELEMETRY.subject(device_id="dev-a")
    other = TELEMETRY.subject(device_id="dev-b")
    decision = PLACEMENT_DECISION.subject(task_id="t1")
    assert await heard(admin, own, lambda: publish(own), within_s=10)
    assert not await heard(admin, other, lambda: publish(other))
    assert not await heard(admin, decision, lambda: publish(decision))
    await nc.subscribe(DVFS_HINT.subject(device_id="dev-b"))  # another device's hints
    await nc.flush()

    def refusals() -> list[str]:
        return [e.lower() for e in device.errors if "permissions violation" in e.lower()]

    await wait_until(lambda: any("subscription" in e and "dev-b" in e for e in refusals()), 10)
    refused = refusals()
    assert any(f'publish to "{other}"' in e for e in refused)
    assert any(f'publish to "{decision}"' in e for e in refused)
    assert any("subscription" in e and "dev-b" in e for e in refused), device.errors
    await nc.close()


async def test_only_the_scheduler_writes_placements_and_shard_tasks(
    server: NatsServer, admin: NatsClient
) -> None:
    decision = PLACEMENT_DECISION.subject(task_id="t2")
    work = SHARD_TASK.subject(device_id="dev-a")
    for user in ("gateway", "scorer", "telemetry", "dev-a"):
        nc = await Client().connect(server, user)
        for subject in (decision, work):

            async def publish(s: str = subject, c: NatsClient = nc) -> None:
                await c.publish(s, b"{}")
                await c.flush()

            assert not await heard(admin, subject, publish), (user, subject)
        await nc.close()
    scheduler = await Client().connect(server, "scheduler")

    async def place() -> None:
        await scheduler.publish(decision, b"{}")
        await scheduler.flush()

    assert await heard(admin, decision, place, within_s=10)
    await scheduler.close()


async def test_only_the_gateway_says_what_a_deployment_measured(
    server: NatsServer, admin: NatsClient
) -> None:
    """The scheduler corrects its predictions by these: a device that could send them would
    steer placements its way."""
    measured = DEPLOYMENT_MEASURED.subject(deployment_id="dep-1")
    for user, allowed in (("dev-a", False), ("scorer", False), ("gateway", True)):
        nc = await Client().connect(server, user)

        async def publish(c: NatsClient = nc) -> None:
            await c.publish(measured, b"{}")
            await c.flush()

        within = 10 if allowed else 0.5
        assert await heard(admin, measured, publish, within_s=within) is allowed, user
        await nc.close()


async def test_a_device_sends_bandwidth_probes_only_on_its_own_subject(
    server: NatsServer, admin: NatsClient
) -> None:
    nc = await Client().connect(server, "dev-a")
    for device, allowed in (("dev-a", True), ("dev-b", False)):
        subject = PROBE.subject(device_id=device)

        async def publish(s: str = subject) -> None:
            await nc.publish(s, b"\0" * 1024)
            await nc.flush()

        within = 10 if allowed else 0.5
        assert await heard(admin, subject, publish, within_s=within) is allowed, device
    await nc.close()


async def test_nobody_gets_in_without_the_password(server: NatsServer) -> None:
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)
    wrong = server.url.replace("nats://", "nats://gateway:not-the-password@")
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(wrong, allow_reconnect=False, max_reconnect_attempts=0)


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    with RedisServer(acl=ACCESS.redis_acl()) as running:
        yield running  # type: ignore[misc]


def as_user(server: RedisServer, user: str) -> redis.Redis:
    return redis.Redis.from_url(ACCESS.redis_url(server.url, user), decode_responses=True)


def test_redis_users_write_only_what_their_service_owns(acl_redis: RedisServer) -> None:
    keys = Keys()
    scorer, scheduler, gateway = (as_user(acl_redis, u) for u in ("scorer", "scheduler", "gateway"))
    scorer.hset(keys.device("dev-a"), "total", "0.5")
    scorer.zadd(keys.rank("total"), {"dev-a": 0.5})
    scheduler.set(keys.mode, "energy")
    scheduler.set(f"{keys.prefix}:models:m", "{}")  # the registry is written by the scheduler
    scheduler.sadd(f"{keys.prefix}:models", "m")
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.set(f"{keys.prefix}:models:m", "{}")
    assert gateway.hget(keys.device("dev-a"), "total") == "0.5"
    assert scheduler.zrevrange(keys.rank("total"), 0, 9) == ["dev-a"]
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.set(keys.mode, "performance")  # the gateway only reads
    with pytest.raises(redis.exceptions.NoPermissionError):
        scheduler.hset(keys.device("dev-a"), "total", "1.0")  # scores are the scorer's
    with pytest.raises(redis.exceptions.NoPermissionError):
        scorer.set(keys.mode, "performance")  # the mode is the scheduler's
    gateway.hset(f"{keys.prefix}:jobs:batch:b", "status", '"in_progress"')  # the Batch API's
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.hset(keys.device("dev-a"), "total", "1.0")
    for user in (gateway, scorer, scheduler):
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.flushall()
    assert scorer.get(keys.mode) == "energy"


def test_redis_refuses_anyone_without_a_password(acl_redis: RedisServer) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(acl_redis.url).ping()
    wrong = acl_redis.url.replace("redis://", "redis://gateway:wrong@")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(wrong).ping()


def test_the_batch_user_carries_a_celery_task_through_a_device_queue(
    acl_redis: RedisServer,
) -> None:
    """Celery's Redis transport as the batch user: the task sent to a device's queue arrives.
    The queue expires, as a Celery worker's control queues do: binding one runs kombu's Lua
    script, which reads the server's clock (a worker crash-looped without ``+time``)."""
    from kombu import Exchange, Queue

    from services.batch.app import make_app, queue_of
    from services.batch.settings import BatchSettings

    broker = ACCESS.redis_url(acl_redis.url.rsplit("/", 1)[0] + "/1", "batch")
    app = make_app(BatchSettings(broker_url=broker))
    name = queue_of("dev-a")
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name, expires=60.0)
    with app.connection_for_write() as conn, conn.SimpleQueue(queue) as consumer:
        app.send_task("tessera.train", args=["job-1", 1], queue=name, connection=conn)
        message = consumer.get(timeout=5)
        message.ack()
    assert message.headers["task"] == "tessera.train"
    assert message.headers["argsrepr"].startswith("['job-1'")


def test_the_batch_sender_reaches_only_the_queue_of_the_batches_requests(
    acl_redis: RedisServer,
) -> None:
    """The gateway's runner (``batch-sender``) puts a request on ``batch.requests``, reads
    its answer and stops a task (a training run); a device's queue, the Batch API's own keys
    and a worker's beat are not its."""
    from celery import Celery

    from libs.contracts.batch_requests import (
        QUEUE,
        TASK,
        alive_key,
        answer_key,
        steps_key,
        stop_key,
    )

    url = ACCESS.redis_url(acl_redis.url.rsplit("/", 1)[0] + "/1", "batch-sender")
    sender = Celery("sender", broker=url)
    sender.send_task(TASK, kwargs={"endpoint": "/v1/embeddings", "body": {}}, queue=QUEUE)
    batch = redis.Redis.from_url(ACCESS.redis_url(acl_redis.url.rsplit("/", 1)[0] + "/1", "batch"))
    assert batch.llen(QUEUE) == 1  # the batch workers' user finds it there
    batch.set(answer_key("tessera", "t1"), "{}")
    mine = redis.Redis.from_url(url)
    assert mine.get(answer_key("tessera", "t1")) == b"{}"
    mine.set(stop_key("tessera", "t1"), 1)
    assert batch.exists(stop_key("tessera", "t1"))  # the worker reads it
    batch.set(steps_key("tessera", "run-1"), 120)  # a training run's step, for the progress
    assert mine.get(steps_key("tessera", "run-1")) == b"120"
    with pytest.raises(kombu.exceptions.OperationalError):
        sender.send_task("tessera.train", args=["job", 1], queue="device.dev-a")
    for forbidden in (
        lambda: mine.get("tessera:jobs:runner"),
        lambda: mine.set(alive_key("tessera", "t1"), "me"),
        lambda: mine.set(steps_key("tessera", "run-1"), 0),
        lambda: mine.lpush("device.dev-a", "x"),
        lambda: mine.delete("_kombu.binding.device.dev-a"),  # the dispatcher's routing
        lambda: mine.sadd("_kombu.binding.device.dev-a", "batch.requests"),
        lambda: mine.flushdb(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
