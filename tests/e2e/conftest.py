"""The e2e tests' shared cluster (``tests/e2e/shared.py``): started for the first test that
asks for ``shared_cluster`` and stopped after the last, the tests that use it run one after
another (so an idle cluster does not take the cores from the tests between them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e import shared
from tests.e2e.cluster import RunningCluster

FIXTURE = "shared_cluster"
RUNNING = pytest.StashKey[RunningCluster]()


def uses_it(item: pytest.Item) -> bool:
    return FIXTURE in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py gives each test its file's group
def pytest_itemcollected(item: pytest.Item) -> None:
    """With two workers, the tests that use the shared cluster run on one, one after another."""
    if uses_it(item):
        item.add_marker(pytest.mark.xdist_group(FIXTURE))


@pytest.hookimpl(trylast=True)  # after any reordering (--reversed, --random-order)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    users = [item for item in items if uses_it(item)]
    if not users:
        return
    first = items.index(users[0])
    others = [item for item in items if not uses_it(item)]
    items[:] = others[:first] + users + others[first:]


@pytest.fixture(scope="session")
def shared_cluster(pytestconfig: pytest.Config) -> Iterator[RunningCluster]:
    running = shared.start()
    pytestconfig.stash[RUNNING] = running
    try:
        running.wait_for("ready:", 300)
        yield running
    finally:
        running.stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last of the tests that use the shared cluster (they run one after another):
    stop it (the session's end would, but later tests would share the cores with it until
    then). Known from the next test, whatever the order, the tests deselected or the worker."""
    if uses_it(item) and (nextitem is None or not uses_it(nextitem)):
        running = item.config.stash.get(RUNNING, None)
        if running is not None:
            running.stop()
