"""The stream's decisions without I/O: ``StreamState`` driven through every path a generation
takes (sent once per epoch, asked again while unacknowledged, silent or missing tokens, waits
for a re-placement while a device is down, follows a newer route and continues after what it
had, gives up with the reason) with the clock passed in."""

from __future__ import annotations

from typing import Any

import pytest

from libs.contracts import TokenChunk
from services.gateway.core.deployed import Route
from services.gateway.core.stream_state import (
    ACK_S,
    RESENDS,
    Arrived,
    AskAgain,
    Emit,
    End,
    Fail,
    Follow,
    Reconnected,
    RouteNews,
    Send,
    StreamState,
    TimedOut,
    Wait,
)

STALL_S, MOVE_S = 60.0, 5.0
FIRST = Route("smol", 1, ("dev-a", "dev-b"))
MOVED = Route("smol", 2, ("dev-c",))


def make_token_chunk(**fields: Any) -> TokenChunk:
    return TokenChunk(request_id="r1", ts=1.0, **fields)


def chunk(index: int, epoch: int = 1, **fields: Any) -> Arrived:
    """A chunk of epoch ``epoch``: token ``100 + index`` unless told otherwise."""
    fields.setdefault("token_id", None if fields.get("finished") else 100 + index)
    return Arrived(make_token_chunk(index=index, epoch=epoch, **fields))


def final(count: int, epoch: int = 1, **fields: Any) -> Arrived:
    """The final chunk of a generation of ``count`` tokens."""
    fields.setdefault("finish_reason", "stop")
    fields.setdefault("completion_tokens", count)
    return chunk(count, epoch, finished=True, **fields)


def started(pieces: bool = False, taken: bool = True, now: float = 0.0) -> StreamState:
    """A stream whose request its first shard took (or not) at ``now``."""
    state = StreamState(FIRST, STALL_S, MOVE_S, pieces=pieces)
    assert state.step(now, set(), False) == Send(FIRST, (), 0)
    assert state.sent(taken, now, False) == Wait(STALL_S if taken else ACK_S)
    return state


def test_a_request_is_sent_once_and_its_tokens_passed_on_in_order() -> None:
    state = started()
    for index in range(3):
        event = chunk(index)
        assert state.handle(event, 1.0) == Emit(event.chunk)
        assert state.step(1.0, set(), False) == Wait(STALL_S)  # not sent again
    assert state.handle(chunk(1), 1.0) is None  # a repeat
    assert state.handle(chunk(7), 1.0) is None  # one past a gap
    assert state.handle(chunk(3, epoch=0), 1.0) is None  # an older epoch's
    done = final(3)
    assert state.handle(done, 1.0) == End(done.chunk)
    assert state.finished and state.generated == [100, 101, 102]


def test_an_unacknowledged_request_is_asked_again_until_the_stall_timeout() -> None:
    state = started(taken=False, now=10.0)
    assert state.handle(TimedOut(), 10.5) == AskAgain("unacked")
    assert state.step(10.5, set(), False) == Send(FIRST, (), 0)
    # Still untaken: counted from the first send, not this one.
    assert state.sent(False, 10.5, False) == Wait(ACK_S)
    assert state.unacked_since == 10.0
    # Past the stall timeout it counts as silent: sent again RESENDS times, then given up.
    for _ in range(RESENDS):
        assert state.handle(TimedOut(), 10.0 + STALL_S) == AskAgain("silent")
        assert isinstance(state.step(10.0 + STALL_S, set(), False), Send)
        state.sent(False, 10.0 + STALL_S, False)
    failed = state.handle(TimedOut(), 10.0 + STALL_S)
    assert failed == Fail("no token from smol (epoch 1) for 60 s", 0, 1, cancel=True)
    assert not state.finished  # the generation may run somewhere: it is cancelled


def test_a_chunk_means_the_request_was_taken() -> None:
    state = started(taken=False)
    assert isinstance(state.handle(chunk(0), 0.1), Emit)
    assert state.step(0.1, set(), False) == Wait(STALL_S)


def test_a_silent_stream_is_asked_again_then_fails_where_it_was() -> None:
    state = started()
    state.handle(chunk(0), 1.0)
    for _ in range(RESENDS):
        assert state.handle(TimedOut(), 61.0) == AskAgain("silent")
        assert state.step(61.0, set(), False) == Send(FIRST, (100,), 0)
        assert state.sent(True, 61.0, False) == Wait(STALL_S)
    assert state.handle(TimedOut(), 200.0) == Fail(
        "no token from smol (epoch 1) for 60 s", 1, 1, cancel=True
    )


def test_after_a_reconnect_the_request_is_sent_again_to_the_same_epoch() -> None:
    state = started()
    state.handle(chunk(0), 1.0)
    assert state.handle(Reconnected(), 2.0) == AskAgain("reconnected")
    assert state.step(2.0, set(), False) == Send(FIRST, (100,), 0)
    assert state.resent == 0  # a reconnect is not a loss


@pytest.mark.parametrize(("loading", "budget"), [(False, MOVE_S), (True, STALL_S)])
def test_a_down_device_waits_for_a_re_placement_from_when_it_went_down(
    loading: bool, budget: float
) -> None:
    """``move_s`` for a re-placement, ``stall_s`` while the re-placed plan loads; counted from
    the first step that saw the device down, whatever news comes meanwhile."""
    state = started()
    assert state.step(10.0, {"dev-b", "dev-z"}, loading) == Wait(budget)
    assert state.handle(RouteNews(FIRST), 12.0) is None  # other news: the same route
    assert state.step(12.0, {"dev-b"}, loading) == Wait(budget - 2.0)
    assert state.handle(TimedOut(), 10.0 + budget) == Fail(
        "no capacity: dev-b failed and smol could not be placed elsewhere", 0, 1, cancel=True
    )


def test_nothing_is_sent_to_a_route_with_a_device_down() -> None:
    state = StreamState(FIRST, STALL_S, MOVE_S)
    assert state.step(0.0, {"dev-a"}, False) == Wait(MOVE_S)
    assert state.step(MOVE_S + 1, {"dev-a"}, False) == Wait(0.0)  # its time is up
    assert state.step(MOVE_S + 1, set(), False) == Send(FIRST, (), 0)  # it recovered
    assert state.down_since is None


def test_a_stream_follows_its_deployment_and_continues_after_what_it_had() -> None:
    state = started()
    state.handle(chunk(0), 1.0)
    state.handle(chunk(1), 1.0)
    assert state.step(2.0, {"dev-a"}, False) == Wait(MOVE_S)  # dev-a failed
    assert state.handle(RouteNews(MOVED), 3.0) == Follow(MOVED)
    assert state.handle(RouteNews(FIRST), 3.0) is None  # an older route is not followed
    assert state.step(3.0, {"dev-a"}, False) == Send(MOVED, (100, 101), 0)
    assert state.sent(True, 3.0, False) == Wait(STALL_S)
    assert state.handle(chunk(2, epoch=1), 3.1) is None  # the old placement's
    assert state.handle(chunk(1, epoch=2), 3.1) is None  # a repeat of the re-run
    assert isinstance(state.handle(chunk(2, epoch=2), 3.1), Emit)
    assert isinstance(state.handle(final(3, epoch=2), 3.2), End)
    assert state.generated == [100, 101, 102]


def test_a_prompt_is_re_run_after_the_pieces_already_streamed() -> None:
    state = started(pieces=True)
    for index in range(2):
        piece = chunk(index, token_id=None, text=f"piece {index}")
        assert state.handle(piece, 1.0) == Emit(piece.chunk)
    state.handle(RouteNews(MOVED), 2.0)
    assert state.step(2.0, set(), False) == Send(MOVED, (), 2)  # ids are not sent: a count
    # A prompt's final chunk counts its pieces by its index.
    assert state.handle(chunk(2, epoch=2, finished=True, finish_reason="stop"), 2.1) == End(
        make_token_chunk(index=2, epoch=2, finished=True, finish_reason="stop")
    )


def test_tokens_lost_on_the_way_are_asked_for_again_and_never_leave_a_hole() -> None:
    state = started()
    state.handle(chunk(0), 1.0)  # token 1 is lost on the way
    for _ in range(RESENDS):
        assert state.handle(final(3), 1.0) == AskAgain("lost")
        assert state.step(1.0, set(), False) == Send(FIRST, (100,), 0)
        state.sent(True, 1.0, False)
    lost = state.handle(final(3), 1.0)
    assert lost == Fail("tokens after 1 were lost on the way", 1, 1, cancel=False)
    assert state.finished  # its engine is done: nothing to cancel


def test_an_engines_error_passes_on_as_it_came() -> None:
    state = started()
    # It counts tokens that never came: an error is passed on, not asked for again.
    error = final(0, finish_reason="error", error="boom", completion_tokens=2)
    assert state.handle(error, 1.0) == End(error.chunk)
