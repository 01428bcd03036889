"""Every named policy: a tiny scenario that can be checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from libs.contracts.admin import POLICY_NAMES
from libs.core.fleet_state import FleetState
from libs.core.model import TaskKind
from libs.core.policies import POLICIES, make_policy
from libs.core.queueing import MlfqQueue, RoundRobinQueue, fcfs_queue, priority_queue, sjf_queue
from tests.builders import make_device, make_task

ISSUE_NAMES = {
    "dwps",
    "random",
    "round_robin",
    "weighted_round_robin",
    "least_connections",
    "power_of_two",
    "source_hash",
    "consistent_hash",
    "fcfs",
    "sjf",
    "priority",
    "mlfq",
    "fair_share",
    "market",
    "ilp",
}


def fleet(n: int = 3, **over: float) -> FleetState:
    return FleetState([make_device(f"d{i}", slots=100, **over) for i in range(n)])


def place(name: str, tasks: list, fleet_state: FleetState | None = None, seed: int = 0) -> list:  # type: ignore[type-arg]
    state = fleet_state or fleet()
    return [
        p.device_id for p in make_policy(name).place(state, tasks, 0.0, np.random.default_rng(seed))
    ]


def tasks(n: int, **over: object) -> list:  # type: ignore[type-arg]
    return [make_task(f"t{i}", intensity=0.01, **over) for i in range(n)]  # type: ignore[arg-type]


def test_registry_has_every_name_the_issue_lists() -> None:
    assert set(POLICIES) >= ISSUE_NAMES
    assert set(POLICIES) == set(POLICY_NAMES)  # what the admin API documents and accepts
    with pytest.raises(KeyError, match="unknown policy 'nope'"):
        make_policy("nope")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_respects_the_hard_filters(name: str) -> None:
    state = FleetState(
        [make_device("small", memory_free_gb=1.0), make_device("big", memory_free_gb=8.0)]
    )
    placed = place(name, [make_task("needs-4gb", memory_gb=4.0)], state)
    assert placed == ["big"]


def test_round_robin_cycles_in_device_order() -> None:
    assert place("round_robin", tasks(5)) == ["d0", "d1", "d2", "d0", "d1"]


def test_weighted_round_robin_follows_speed() -> None:
    state = FleetState(
        [make_device("slow", speed=1.0, slots=100), make_device("fast", speed=3.0, slots=100)]
    )
    placed = place("weighted_round_robin", tasks(8), state)
    assert placed.count("fast") == 6 and placed.count("slow") == 2


def test_least_connections_picks_the_least_loaded() -> None:
    state = FleetState([make_device("busy", load=0.5), make_device("idle", load=0.0)])
    assert place("least_connections", tasks(1), state) == ["idle"]


def test_power_of_two_never_picks_the_busier_of_its_pair() -> None:
    state = FleetState([make_device("busy", load=5.0), make_device("idle", load=0.0)])
    assert place("power_of_two", tasks(1), state) == ["idle"]


def test_random_is_seeded() -> None:
    assert place("random", tasks(6), seed=3) == place("random", tasks(6), seed=3)


@pytest.mark.parametrize("name", ["source_hash", "consistent_hash"])
def test_hashing_policies_keep_a_source_on_one_device(name: str) -> None:
    same_source = [make_task(f"t{i}", source="alice", intensity=0.01) for i in range(4)]
    assert len(set(place(name, same_source))) == 1


def test_sjf_places_the_shortest_job_first() -> None:
    state = FleetState([make_device("only", slots=1, power_max_w=8.0, power_idle_w=5.0)])
    jobs = [make_task("long", work=9.0, intensity=0.6), make_task("short", work=1.0, intensity=0.6)]
    assert place("sjf", jobs, state) == [None, "only"]
    assert place(
        "fcfs", jobs, FleetState([make_device("only", power_max_w=8.0, power_idle_w=5.0)])
    ) == ["only", None]


def test_priority_places_the_highest_priority_first() -> None:
    state = FleetState([make_device("only", slots=1, power_max_w=8.0, power_idle_w=5.0)])
    jobs = [
        make_task("low", priority=1, intensity=0.6),
        make_task("high", priority=5, intensity=0.6),
    ]
    assert place("priority", jobs, state) == [None, "only"]


def test_market_sells_to_the_highest_bid_and_refuses_low_bids() -> None:
    state = fleet(1)
    bids = [
        make_task("cheap", bid=0.01, intensity=0.01),
        make_task("rich", bid=10.0, intensity=0.01),
    ]
    placements = make_policy("market").place(state, bids, 0.0, np.random.default_rng(0))
    assert placements[1].device_id == "d0"
    assert placements[0].device_id is None and placements[0].reason


def test_fair_share_lets_the_quiet_source_go_first() -> None:
    state = FleetState([make_device("only", power_max_w=8.0, power_idle_w=5.0)])
    policy = make_policy("fair_share")
    rng = np.random.default_rng(0)
    policy.place(state, [make_task("a0", source="alice", work=10.0, intensity=0.6)], 0.0, rng)
    state = FleetState([make_device("only", power_max_w=8.0, power_idle_w=5.0)])
    batch = [
        make_task("a1", source="alice", intensity=0.6),
        make_task("b1", source="bob", intensity=0.6),
    ]
    assert [p.device_id for p in policy.place(state, batch, 1.0, rng)] == [None, "only"]


def test_static_allocation_partitions_devices_by_task_kind() -> None:
    jobs = [make_task(f"j{i}", kind=TaskKind.JOB, intensity=0.01) for i in range(3)]
    assert set(place("static", jobs, fleet(6))) == {"d2", "d5"}


def test_dynamic_allocation_picks_the_earliest_finish() -> None:
    state = FleetState(
        [make_device("slow-idle", speed=1.0), make_device("fast-busy", speed=10.0, load=2.0)]
    )
    assert place("dynamic", tasks(1), state) == ["fast-busy"]  # 3 × 1/10 < 1 × 1/1


def test_queue_disciplines_pop_in_their_order() -> None:
    a = make_task("a", work=5.0, priority=1, release=0.0)
    b = make_task("b", work=1.0, priority=9, release=1.0)
    for factory, first in ((fcfs_queue, "a"), (sjf_queue, "b"), (priority_queue, "b")):
        queue = factory()
        queue.push(a, 0.0)
        queue.push(b, 1.0)
        item = queue.pop(2.0)
        assert item is not None and item[0].task_id == first and item[1] is None


def test_round_robin_time_slice_requeues_at_the_back() -> None:
    queue = RoundRobinQueue(time_slice_s=0.5)
    queue.push(make_task("a"), 0.0)
    queue.push(make_task("b"), 0.0)
    task, slice_s = queue.pop(0.0)  # type: ignore[misc]
    assert (task.task_id, slice_s) == ("a", 0.5)
    queue.requeue(task, 0.5, 0.5)
    assert [queue.pop(1.0)[0].task_id, queue.pop(1.0)[0].task_id] == ["b", "a"]  # type: ignore[index]


def test_mlfq_demotes_on_a_used_slice_and_boosts_periodically() -> None:
    queue = MlfqQueue(levels=3, base_slice_s=0.1, boost_period_s=10.0)
    queue.push(make_task("long"), 0.0)
    task, slice_s = queue.pop(0.0)  # type: ignore[misc]
    assert slice_s == pytest.approx(0.1)
    queue.requeue(task, 0.1, 0.1)
    assert queue.level_of("long") == 1
    queue.push(make_task("new"), 0.2)
    assert queue.pop(0.2)[0].task_id == "new"  # type: ignore[index]
    task, slice_s = queue.pop(0.3)  # type: ignore[misc]
    assert (task.task_id, slice_s) == ("long", pytest.approx(0.2))
    queue.requeue(task, 0.05, 0.35)  # gave up early: stays at its level
    assert queue.level_of("long") == 1
    queue.pop(10.5)
    assert queue.level_of("long") == 0  # boosted
