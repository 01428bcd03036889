"""What a generation's stream does next, decided without I/O: the state of one request that
the gateway sends to a deployment and follows until its last chunk.

``GenerationClient.stream`` is the I/O shell around it; the shell loops:

1. ``step(now, down, loading)`` with what the deployment book says now (the devices of the
   stream's route that are down, whether its deployment is still loading) returns ``Send``
   (send the request to this route's first shard, then report ``sent``) or ``Wait`` (wait for
   the stream's inbox at most that long). ``sent(taken, now, loading)`` returns the ``Wait``.
2. What the wait brought is handed to ``handle`` as an event: ``Arrived`` (a chunk),
   ``RouteNews`` (the book woke the stream: its deployment moved, a device of its route
   failed or recovered, its phase changed; the event carries the book's newest route),
   ``Reconnected`` (messages may have been lost), ``TimedOut`` (the wait ran out). It returns
   an outcome (``Emit``, ``End``, ``Fail``, ``Follow``, ``AskAgain``) or None (a chunk of an
   old epoch, a repeat, news of nothing new), and the shell goes back to 1.

The rules: a request is sent to its route's first shard once per epoch, and not while a device
of the route is down. A first shard that does not take it within ``ACK_S`` is asked again until
``stall_s``. While a device is down the stream waits ``move_s`` for a re-placement (``stall_s``
while the re-placed deployment loads), counted from when it went down; then it gives up. A
route of a newer epoch is followed: the request is sent there with what was already streamed,
so the model continues after it. Without a chunk for ``stall_s``, or with a final chunk that
counts more than arrived, the request is sent again ``RESENDS`` times before the stream fails;
it never ends with a hole. Chunks of another epoch and repeats are dropped.

Times are seconds of a monotonic clock, passed in.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from libs.contracts import TokenChunk
from services.gateway.core.deployed import Route

#: How often a request is sent again when its tokens go missing, before it fails.
RESENDS = 2
#: The first shard acknowledges a request within this long, or it is sent again (until the
#: stall timeout).
ACK_S = 0.5


# -- what the shell does next ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send the request to ``route``'s first shard: with ``generated`` (the token ids streamed
    so far) for an engine of token ids, or ``delivered`` (the pieces streamed so far) for an
    engine that answers a prompt in pieces; then report ``StreamState.sent``."""

    route: Route
    generated: tuple[int, ...]
    delivered: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the stream's inbox ``seconds`` at most (0: take only what is there)."""

    seconds: float


# -- what happened -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrived:
    """A chunk of the request came from a device of its route."""

    chunk: TokenChunk


@dataclass(frozen=True, slots=True)
class RouteNews:
    """The deployment book woke the stream; ``newest`` is its route of the deployment now."""

    newest: Route | None


@dataclass(frozen=True, slots=True)
class Reconnected:
    """Messages may have been lost (the bus reconnected): the request or its chunks."""


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The last ``Wait`` ran out with nothing in the inbox."""


Event = Arrived | RouteNews | Reconnected | TimedOut


# -- outcomes of an event ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Emit:
    """Pass the chunk on to the caller; the stream goes on."""

    chunk: TokenChunk


@dataclass(frozen=True, slots=True)
class End:
    """Pass the request's final chunk on; the stream is over (the generation ended)."""

    chunk: TokenChunk


@dataclass(frozen=True, slots=True)
class Fail:
    """End the stream with a failure chunk (``index``, ``epoch``, ``message``); ``cancel``: the
    generation may still run somewhere and is to be cancelled (False: its engine finished)."""

    message: str
    index: int
    epoch: int
    cancel: bool


@dataclass(frozen=True, slots=True)
class Follow:
    """The deployment moved: the stream follows it to ``route`` (sent there at the next step,
    once none of its devices is down)."""

    route: Route


@dataclass(frozen=True, slots=True)
class AskAgain:
    """The request is sent again at the next step: ``unacked`` (no first shard took it yet),
    ``silent`` (no chunk for ``stall_s``), ``lost`` (its final chunk counts more than arrived),
    ``reconnected`` (the bus reconnected)."""

    reason: Literal["unacked", "silent", "lost", "reconnected"]


Outcome = Emit | End | Fail | Follow | AskAgain


@dataclass
class StreamState:
    """One request's stream (see the module). ``pieces``: the request is a prompt that an
    engine answers in pieces (text, whole tool calls) rather than token ids; a piece counts as
    one, and a re-run skips the pieces already streamed."""

    route: Route
    stall_s: float
    move_s: float
    pieces: bool = False
    #: The token ids streamed so far (0 for each piece).
    generated: list[int] = field(default_factory=list)
    #: The epoch the request was last sent to (-1: send it again).
    sent_epoch: int = -1
    #: Times it was sent again because chunks went missing on the way.
    resent: int = 0
    #: Since when no first shard has taken it (None: one has).
    unacked_since: float | None = None
    #: Since when a device of its route is down (None: none is).
    down_since: float | None = None
    #: The devices of its route down at the last step.
    down: tuple[str, ...] = ()
    #: The generation ended: its final chunk (or a failure for it) was passed on.
    finished: bool = False
    #: The wait while tokens stream, made once (it is the next step after every token).
    _streaming: Wait = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._streaming = Wait(self.stall_s)

    def step(self, now: float, down: Collection[str], loading: bool) -> Send | Wait:
        """The next thing to do: ``down`` are the devices the book has down (those of the
        route count), ``loading`` whether the deployment's current plan still loads."""
        self.down = tuple([d for d in self.route.devices if d in down]) if down else ()
        # Since when its devices are down: news of other deployments or devices, or of this
        # one's phase, must not keep restarting the wait for a new route.
        if not self.down:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = now
        if not self.down and self.sent_epoch != self.route.epoch:
            return Send(
                self.route,
                () if self.pieces else tuple(self.generated),
                len(self.generated) if self.pieces else 0,
            )
        return self._wait(now, loading)

    def sent(self, taken: bool, now: float, loading: bool) -> Wait:
        """The request was sent as ``step`` said; ``taken``: its first shard acknowledged it."""
        self.sent_epoch = self.route.epoch
        if taken:
            self.unacked_since = None
        elif self.unacked_since is None:
            self.unacked_since = now
        return self._wait(now, loading)

    def _wait(self, now: float, loading: bool) -> Wait:
        if self.down and loading:
            wait = self.stall_s  # re-placed: its new plan loads, then it moves
        elif self.down:
            wait = self.move_s
        elif self.unacked_since is None:
            return self._streaming  # the common case, once per token: nothing new to make
        else:
            wait = ACK_S
        if self.down_since is not None:
            wait = max(0.0, self.down_since + wait - now)
        return Wait(wait)

    def handle(self, event: Event, now: float) -> Outcome | None:
        """What ``event`` means for the stream; then the shell takes the next ``step``
        (unless the outcome is ``End`` or ``Fail``)."""
        if isinstance(event, Arrived):
            return self._arrived(event.chunk)
        if isinstance(event, RouteNews):
            newer = event.newest
            if newer is not None and newer.epoch > self.route.epoch:
                self.route = newer
                return Follow(newer)
            return None
        if isinstance(event, Reconnected):
            self.sent_epoch = -1  # its request or chunks may be gone: send it again
            return AskAgain("reconnected")
        return self._timed_out(now)

    def _timed_out(self, now: float) -> Outcome:
        unacked = self.unacked_since
        if not self.down and unacked is not None and now - unacked < self.stall_s:
            self.sent_epoch = -1  # nobody took it yet (a worker reconnecting): ask again
            return AskAgain("unacked")
        if not self.down and self.resent < RESENDS:  # its chunks were lost: ask again
            self.resent, self.sent_epoch = self.resent + 1, -1
            return AskAgain("silent")
        deployment = self.route.deployment_id
        message = (
            f"no capacity: {', '.join(self.down)} failed and {deployment} could not be "
            "placed elsewhere"
            if self.down
            else f"no token from {deployment} (epoch {self.route.epoch}) for {self.stall_s:.0f} s"
        )
        return Fail(message, len(self.generated), self.route.epoch, cancel=True)

    def _arrived(self, chunk: TokenChunk) -> Outcome | None:
        if chunk.epoch != self.route.epoch:
            return None  # from the placement before the move
        self.unacked_since = None  # the placement is working on it
        if chunk.finished:
            counted = chunk.index if self.pieces else chunk.completion_tokens
            missing = (counted or 0) > len(self.generated)
            failed = chunk.finish_reason == "error"
            if missing and not failed and self.resent < RESENDS:
                # A token was lost in transit (a server restart): run it again after the
                # tokens that did arrive, rather than end the stream with a hole.
                self.resent, self.sent_epoch = self.resent + 1, -1
                return AskAgain("lost")
            self.finished = True
            if missing and not failed:  # never a stream with a hole
                message = f"tokens after {len(self.generated)} were lost on the way"
                return Fail(message, len(self.generated), chunk.epoch, cancel=False)
            return End(chunk)
        if chunk.index == len(self.generated) and chunk.token_id is not None:
            self.generated.append(chunk.token_id)
            return Emit(chunk)
        if chunk.index == len(self.generated) and self.pieces:
            self.generated.append(0)  # a piece: counted, its text is the user's already
            return Emit(chunk)
        return None  # a repeat, or one past a gap
