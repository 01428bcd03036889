"""The deployment book: one immutable value, changed only by ``apply``; followers apply the
same numbered events and know when one is missing; one rule for what a name means."""

from __future__ import annotations

import pytest

from libs.contracts import (
    Assignment,
    DeploymentPlanned,
    DeploymentRemoved,
    DeploymentState,
    DeploymentStopped,
    ShardProgress,
    ShardReported,
)
from libs.deployments import (
    DeploymentBook,
    apply,
    follow,
    other_groups,
    phases,
    record,
    resolve,
    serving_models,
)

NOW = 1_700_000_000.0


def plan(
    name: str, model: str = "m", devices: tuple[str, ...] = ("a",), **fields: object
) -> DeploymentState:
    layers = 30 // len(devices)
    deployment = DeploymentState(
        deployment_id=name,
        model=model,
        epoch=int(fields.pop("epoch", 1)),  # type: ignore[call-overload]
        context_length=2048,
        assignments=tuple(
            Assignment(
                device_id=d,
                shard_index=i,
                layer_start=i * layers,
                layer_end=(i + 1) * layers,
                memory_gb=0.5,
            )
            for i, d in enumerate(devices)
        ),
        **fields,  # type: ignore[arg-type]
    )
    return phases.planned(deployment, ())


def loaded(name: str, device: str, index: int = 0, epoch: int = 1) -> ShardReported:
    shard = ShardProgress(device_id=device, shard_index=index, state="loaded", progress=1.0)
    return ShardReported(deployment_id=name, epoch=epoch, shard=shard)


def test_each_change_makes_a_new_book_and_leaves_the_old_one_as_it_was() -> None:
    empty = DeploymentBook(term="t")
    planned = apply(empty, DeploymentPlanned(deployment=plan("d", devices=("a", "b"))))
    assert len(empty) == 0 and empty.index == 0
    assert planned.index == 1 and planned.by_id["d"].phase == "pending"
    half = apply(planned, loaded("d", "a"))
    assert half.by_id["d"].phase == "loading" and planned.by_id["d"].phase == "pending"
    serving = apply(half, loaded("d", "b", index=1))
    assert serving.by_id["d"].phase == "serving" and serving.index == 3
    with pytest.raises(TypeError):
        serving.by_id["x"] = plan("x")  # type: ignore[index]


def test_a_report_of_another_epoch_or_a_gone_deployment_changes_nothing_but_the_index() -> None:
    book = apply(DeploymentBook(term="t"), DeploymentPlanned(deployment=plan("d", epoch=2)))
    stale = apply(book, loaded("d", "a", epoch=1))
    assert stale.by_id == book.by_id and stale.index == book.index + 1
    unknown = apply(book, loaded("nope", "a"))
    assert unknown.by_id == book.by_id


def test_a_stop_keeps_its_reason_and_the_devices_it_leaves_out_and_holds_no_memory() -> None:
    book = apply(DeploymentBook(term="t"), DeploymentPlanned(deployment=plan("d")))
    assert book.reserved_gb() == {"a": 0.5}
    stopped = apply(
        book,
        DeploymentStopped(deployment_id="d", phase="refused", reason="too big", refused_by=("a",)),
    )
    deployment = stopped.by_id["d"]
    assert (deployment.phase, deployment.reason, deployment.refused_by) == (
        "refused",
        "too big",
        ("a",),
    )
    assert stopped.reserved_gb() == {} and stopped.live() == []
    assert "d" not in apply(stopped, DeploymentRemoved(deployment_id="d"))


def test_a_follower_applies_the_next_event_ignores_old_ones_and_says_when_one_is_missing() -> None:
    writer = DeploymentBook(term="t1")
    writer, events = record(
        writer,
        [
            DeploymentPlanned(deployment=plan("d")),
            loaded("d", "a"),
            DeploymentRemoved(deployment_id="d"),
        ],
        NOW,
    )
    assert [e.index for e in events] == [1, 2, 3]
    follower = DeploymentBook.of(DeploymentBook(term="t1").snapshot(NOW))
    follower, said = follow(follower, events[0])
    assert said == "applied" and follower.by_id["d"].phase == "pending"
    same, said = follow(follower, events[0])
    assert said == "old" and same is follower
    skipped, said = follow(follower, events[2])  # events[1] was lost
    assert said == "missing" and skipped is follower
    follower, _ = follow(follower, events[1])
    follower, said = follow(follower, events[2])
    assert said == "applied" and follower.by_id == writer.by_id and follower.index == writer.index
    # A new leader numbers from its checkpoint under a term of its own: a follower asks again.
    new_leader, [first] = record(
        writer.restored("t2"), [DeploymentPlanned(deployment=plan("e"))], NOW
    )
    assert follow(follower, first)[1] == "missing"
    assert DeploymentBook.of(new_leader.snapshot(NOW)).by_id == new_leader.by_id


def test_a_name_means_a_deployment_id_else_the_copy_of_that_model_furthest_along() -> None:
    """The gateway preferred a copy that served, the scheduler took the lowest id in any
    phase: a loading ``a`` and a serving ``b`` of one model sent a request to ``a`` from the
    scheduler and ``b`` from the gateway. One rule now, for both."""
    book = DeploymentBook(term="t")
    for change in (
        DeploymentPlanned(deployment=plan("a", model="m", devices=("x",))),
        DeploymentPlanned(deployment=plan("b", model="m", devices=("y",))),
        loaded("b", "y"),
        DeploymentPlanned(deployment=plan("c", model="other", devices=("z",))),
        DeploymentStopped(deployment_id="c", phase="failed", reason="gone"),
    ):
        book = apply(book, change)
    assert resolve("m", book).deployment_id == "b"  # type: ignore[union-attr]
    assert resolve("a", book).deployment_id == "a"  # type: ignore[union-attr]
    assert resolve("other", book).phase == "failed"  # type: ignore[union-attr]
    assert resolve("nothing", book) is None
    assert serving_models(book) == ["m"]


def test_a_replica_leads_to_its_group() -> None:
    book = DeploymentBook(term="t")
    book = apply(book, DeploymentPlanned(deployment=plan("d", devices=("x",))))
    book = apply(book, DeploymentPlanned(deployment=plan("d-r2", devices=("y",), replica_of="d")))
    book = apply(book, loaded("d-r2", "y"))
    chosen = resolve("m", book)
    assert chosen is not None and chosen.deployment_id == "d-r2" and chosen.base == "d"
    assert [d.deployment_id for d in book.group("d")] == ["d", "d-r2"]


def test_the_other_serving_groups_of_a_model_are_its_edge_copies() -> None:
    """EdgeFlow's edge: each other group of the model whose first copy serves, by its id; not
    the group the name goes to, not a replica, not a copy still loading, and none when a
    request names a copy itself."""
    book = DeploymentBook(term="t")
    for change in (
        DeploymentPlanned(deployment=plan("m", devices=("x",))),
        loaded("m", "x"),
        DeploymentPlanned(deployment=plan("m-r2", devices=("w",), replica_of="m")),
        loaded("m-r2", "w"),
        DeploymentPlanned(deployment=plan("m-laptop", devices=("y",))),
        loaded("m-laptop", "y"),
        DeploymentPlanned(deployment=plan("m-phone", devices=("z",))),  # still loading
        DeploymentPlanned(deployment=plan("o", model="other", devices=("v",))),
        loaded("o", "v"),
    ):
        book = apply(book, change)
    assert resolve("m", book).base == "m"  # type: ignore[union-attr]
    assert other_groups("m", book) == ["m-laptop"]
    assert other_groups("m-laptop", book) == []  # a copy named: that one
    assert other_groups("nothing", book) == []
