"""Shared fixtures: real nats-server and redis-server on free ports, clients, unique names.

Two workers run the tests side by side (``make test``), a file's tests on one of them, then
the tests marked ``alone`` one at a time. Two things for the whole run: ``--reversed`` runs the
tests in reverse order (with pytest-random-order's ``--random-order`` a test that needs another
to run first shows up), and a run fails when a process it started outlives it
(``tests/leftovers.py``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client as NatsClient
from redis.asyncio import Redis

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.redis_client import connect_redis
from tests import leftovers


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reversed",
        action="store_true",
        help="run the tests in the reverse of their usual order",
    )


#: What a test's processes are given under two workers: a core each. llama.cpp's threads and
#: OpenMP's (torch) wait for each other at every step; with two servers of two threads on two
#: cores, each waits on a thread descheduled for the other's: 6 completions on each of two
#: llama-servers took 12.3 s at 2 threads each and 3.6 s at 1 (2.2 s for one server alone).
ONE_CORE = {"TESSERA_WORKER_LLAMA_THREADS": "1", "OMP_NUM_THREADS": "1"}


def pytest_configure(config: pytest.Config) -> None:
    leftovers.mark_this_run()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of several: a test sets its own
        for name, value in ONE_CORE.items():
            os.environ.setdefault(name, value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reversed"):
        items.reverse()


def pytest_itemcollected(item: pytest.Item) -> None:
    """With two workers (``make test``: pytest-xdist's ``--dist loadgroup``) the tests of one
    file run on one worker, one after another: a module's fixtures (a cluster, a server)
    start once. A test grouped already (``tests/e2e/conftest.py``: the shared cluster's) keeps
    its group."""
    if item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    left = leftovers.still_running()
    if left:
        session.config.stash[leftovers.FOUND] = left
        leftovers.kill(left)  # named below; the next run must not find them
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(leftovers.FOUND, [])
    if left:
        terminalreporter.section("processes that outlived the run", red=True)
        for process in left:
            terminalreporter.line(str(process), red=True)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    client = await connect_nats(nats_server.url, "test")
    yield client
    await close_nats(client)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = connect_redis(redis_server.url)
    await client.ping()
    yield client
    await client.aclose()


@pytest.fixture
def uid() -> str:
    """A unique, subject-safe token so tests never see each other's messages or keys."""
    return "t" + uuid.uuid4().hex[:12]
