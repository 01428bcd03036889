"""One loaded shard and the requests passing through it, stepped as one batch — compute only.

``ShardEngine`` turns what arrives (a ``GenerationRequest`` on the first shard, ``STEP`` frames
on the others, sampled tokens coming back to the first) into ``Send`` and ``Emit`` actions; the
torch worker (worker.py) does the publishing and decides when to step. The pipeline is a ring:
the first shard embeds the prompt and sends hidden states on, each shard runs its layers, the
last samples a token, streams it to the user and sends it back to the first shard for the next
step. A one-shard placement runs the ring inside one engine.

Continuous batching: a step runs every request that has rows to run, together — one decoded
token for each request in decode, plus prompt chunks of new requests up to ``PREFILL_BUDGET``
rows, so a long prompt joins without stalling the others' decoding. Each request keeps its own
slot of the shard's KV cache; one that finishes or is cancelled frees its slot and the rest go
on. When every slot is taken, a new request waits on the first shard (as many may wait as there
are slots; beyond that the shard is ``full`` and the service refuses) and takes the next free
slot. Frames between shards carry a step's rows for all its requests (``StepRow``s), not one
frame per request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch

from libs.contracts import (
    Frame,
    FrameKind,
    GenerationRequest,
    ShardTask,
    StepRow,
    TokenChunk,
    step_frame,
)
from services.worker.torch.actions import Action, Emit, Send, frame_states, states_frames
from services.worker.torch.decoding import Decoder, TextStream, sample
from services.worker.torch.kernels import Segment
from services.worker.torch.shard import ShardModel

log = logging.getLogger(__name__)

#: Prompt rows run per step, over all requests: new prompts join in chunks of at most this.
PREFILL_BUDGET = 256


@dataclass
class Live:
    """One request's state on this shard."""

    request: GenerationRequest
    slot: int
    position: int = 0  #: rows already in the KV cache
    index: int = 0  #: next token index (last shard)
    text: TextStream | None = None
    todo: list[int] = field(default_factory=list)  #: first shard: token ids still to run
    decoding: bool = False  #: first shard: the whole prompt has been sent on
    touched: float = field(default_factory=time.monotonic)


@dataclass
class Entry:
    """A request's rows in the step being built."""

    live: Live
    row: StepRow
    rows: torch.Tensor


class ShardEngine:
    """One shard's requests and KV cache. Not thread-safe, and it need not be: its worker
    changes it from one place at a time, its compute loop, which applies what arrives in
    order between steps (``cancel`` and ``expire`` through the worker's queue, on the torch
    thread where ``step`` runs), so nothing changes ``live`` or ``waiting`` during a step."""

    def __init__(
        self,
        model: ShardModel,
        task: ShardTask,
        route: tuple[str, ...],
        tokenizer: Decoder,
        stop_token_ids: frozenset[int],
        clock: Callable[[], float] = time.time,
        slots: int = 16,
    ) -> None:
        self.model = model
        self.task = task
        self.route = route
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.clock = clock
        self.slots = slots
        self.cache = model.new_cache(slots)
        self.live: dict[str, Live] = {}
        self.waiting: deque[GenerationRequest] = deque()  #: first shard: admitted, no slot yet
        self.inbox: list[tuple[StepRow, torch.Tensor]] = []  #: later shards: rows to run
        self.tokens = 0  #: tokens sampled here (last shard)
        #: Rows run in the last step. A batch or a prompt chunk runs more FLOP/s than one row;
        #: the speed a device reports (its honesty check) is measured on one-row steps only,
        #: as its warm-up measures it, so that devices compare like for like.
        self.rows = 0
        self.context = model.context

    @property
    def first(self) -> bool:
        return self.model.spec.first

    @property
    def last(self) -> bool:
        return self.model.spec.last

    @property
    def epoch(self) -> int:
        return self.task.epoch

    @property
    def ready(self) -> bool:
        """Something to run in the next step."""
        return (
            bool(self.inbox)
            or any(live.todo for live in self.live.values())
            or bool(self.waiting and len(self.live) < self.slots)
        )

    @property
    def full(self) -> bool:
        """Every slot taken and as many requests waiting: a new one would be refused."""
        return len(self.live) >= self.slots and len(self.waiting) >= self.slots

    # -- what arrives ---------------------------------------------------------------------------
    def admit(self, request: GenerationRequest) -> list[Action]:
        """First shard: a new request (or a re-run that continues after streamed tokens); its
        prompt runs in the coming steps, once it has a slot."""
        ids = [*request.prompt_token_ids, *request.generated_token_ids]
        if len(ids) >= self.context:
            return [self._error(request, f"prompt of {len(ids)} tokens fills the context")]
        self.cancel(request.request_id)  # a re-run replaces what was here
        if self.full:
            return [self._error(request, self.busy())]
        self.waiting.append(request)
        self._fill()
        return []

    def busy(self) -> str:
        return (
            f"{self.task.device_id} is busy: {len(self.live)} requests running "
            f"and {len(self.waiting)} waiting"
        )

    def _fill(self) -> None:
        """First shard: waiting requests take the free slots, in order."""
        while self.waiting and len(self.live) < self.slots:
            request = self.waiting.popleft()
            live = self._open(request)
            assert live is not None
            live.todo = [*request.prompt_token_ids, *request.generated_token_ids]

    def receive(self, frame: Frame, rows: list[StepRow], cancelled: Container[str] = ()) -> None:
        """Take a step frame's rows: ENDs and sampled tokens at once, states for the next step."""
        data = frame_states(frame)
        offset = 0
        for row in rows:
            part, offset = data[offset : offset + row.rows], offset + row.rows
            if row.request_id in cancelled:
                continue
            if row.kind == FrameKind.END:
                self.cancel(row.request_id)
            elif row.kind == FrameKind.TOKEN:
                live = self.live.get(row.request_id)
                # Dropped when finished or cancelled meanwhile, or from a run since replaced.
                if self.first and live is not None and row.position == live.position:
                    live.todo = [row.token or 0]
            elif not self.first:
                self.inbox.append((row, part))

    def cancel(self, request_id: str) -> bool:
        """Drop a request, running or waiting; whether it was here."""
        waiting = len(self.waiting)
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        return self.live.pop(request_id, None) is not None or len(self.waiting) < waiting

    def expire(self, idle_s: float) -> list[str]:
        """Drop requests idle for ``idle_s`` (their END was lost); returns their ids."""
        cutoff = time.monotonic() - idle_s
        stale = [rid for rid, live in self.live.items() if live.touched < cutoff]
        for rid in stale:
            del self.live[rid]
        return stale

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[Action]:
        """Run everything ready as one batch; returns what to send and stream."""
        actions: list[Action] = []
        entries = self._gather_first() if self.first else self._gather(actions)
        self.rows = sum(e.row.rows for e in entries)
        if not entries:
            return actions
        rows = torch.cat([e.rows for e in entries])
        segments = [Segment(e.live.slot, e.row.position, e.row.rows) for e in entries]
        try:
            out = self.model.step(rows, segments, self.cache)
        except Exception as exc:
            log.exception("shard step failed", extra={"requests": len(entries)})
            return actions + [self._fail(e.live, f"{type(exc).__name__}: {exc}") for e in entries]
        now = time.monotonic()
        for e in entries:
            e.live.position += e.row.rows
            e.live.touched = now
        if self.last:
            return actions + self._sample(entries, out)
        return actions + self._forward(entries, out)

    def _gather_first(self) -> list[Entry]:
        """First shard: each decoding request's next token, then prompt chunks within budget."""
        self._fill()
        entries: list[Entry] = []
        budget = PREFILL_BUDGET
        # Longest-waiting first. Over several shards, a step takes 1/shards of the decoding
        # requests: as many micro-batches circulate as there are shards, so every shard has
        # one to run instead of waiting for the single batch to come round.
        lives = sorted(self.live.values(), key=lambda live: (not live.decoding, live.touched))
        decoding = sum(live.decoding for live in lives)
        decodes = -(-decoding // len(self.route))
        for live in lives:
            if not live.todo or (not live.decoding and budget == 0):
                continue
            if live.decoding:
                if decodes == 0:
                    continue
                decodes -= 1
            take = 1 if live.decoding else min(len(live.todo), budget)
            ids, live.todo = live.todo[:take], live.todo[take:]
            if live.decoding:
                row = StepRow(
                    request_id=live.request.request_id,
                    kind=FrameKind.DECODE,
                    position=live.position,
                    rows=1,
                    final=True,
                )
            else:
                budget -= take
                live.decoding = not live.todo
                row = StepRow(
                    request_id=live.request.request_id,
                    kind=FrameKind.PREFILL,
                    position=live.position,
                    rows=take,
                    final=live.decoding,
                    request=live.request if live.position == 0 else None,
                )
            entries.append(Entry(live, row, torch.tensor(ids, dtype=torch.long)))
        return entries

    def _gather(self, actions: list[Action]) -> list[Entry]:
        """Later shards: the rows received since the last step, in order; stale ones dropped."""
        entries: list[Entry] = []
        expected: dict[str, int] = {}
        inbox, self.inbox = self.inbox, []
        for row, rows in inbox:
            rid = row.request_id
            if row.request is not None and row.position == 0:
                live = self._open(row.request)
                if live is None:
                    actions.append(self._error(row.request, f"{self.task.device_id} is full"))
                    continue
            live = self.live.get(rid)
            if live is None:
                continue  # finished or cancelled meanwhile
            position = expected.get(rid, live.position)
            if row.position != position:
                continue  # from a run of this request that was since started again
            expected[rid] = position + row.rows
            entries.append(Entry(live, row, rows))
        return entries

    def _forward(self, entries: list[Entry], out: torch.Tensor) -> list[Action]:
        """Send the step's states on to the next shard."""
        assert self.task.next_device_id is not None
        states = torch.split(out, [e.row.rows for e in entries])
        parts = [(e.row, s) for e, s in zip(entries, states, strict=True)]
        return states_frames(self.epoch, self.task.next_device_id, parts)

    def _sample(self, entries: list[Entry], logits: torch.Tensor) -> list[Action]:
        """Last shard: a token for each request whose step ended its prompt or decoded."""
        actions: list[Action] = []
        back: list[StepRow] = []
        ends: list[StepRow] = []
        for i, e in enumerate(entries):
            if not e.row.final:
                continue
            live, request = e.live, e.live.request
            rid, text = request.request_id, live.text
            assert text is not None
            token = sample(logits[i : i + 1], request.sampling, rid, live.index)
            self.tokens += 1
            reason: str | None = None
            if token in self.stop_token_ids:
                reason = "stop"
            else:
                piece = text.push(token)
                actions.append(Emit(self._chunk(rid, live.index, token_id=token, text=piece)))
                live.index += 1
                if text.stopped:
                    reason = "stop"
                elif live.index >= request.sampling.max_tokens or live.position + 1 >= self.context:
                    reason = "length"
            if reason is None:
                if self.first:
                    live.todo = [token]
                else:
                    back.append(
                        StepRow(
                            request_id=rid,
                            kind=FrameKind.TOKEN,
                            position=live.position,
                            token=token,
                        )
                    )
                continue
            self.live.pop(rid, None)
            done = self._chunk(
                rid,
                live.index,
                text=text.flush(),
                finished=True,
                finish_reason=reason,
                stop_sequence=text.stop_word,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=live.index,
            )
            actions.append(Emit(done))
            ends.append(StepRow(request_id=rid, kind=FrameKind.END, reason=reason))
        if back:  # first: the ring's hand-off goes out before the chunks for the users
            actions.insert(0, Send(self.route[0], step_frame(self.epoch, back)))
        if ends:
            frame = step_frame(self.epoch, ends)
            actions += [Send(d, frame) for d in self.route if d != self.task.device_id]
        return actions

    # -- requests -------------------------------------------------------------------------------
    def _open(self, request: GenerationRequest) -> Live | None:
        self.live.pop(request.request_id, None)  # a re-run replaces what was here
        taken = {live.slot for live in self.live.values()}
        free = next((s for s in range(self.slots) if s not in taken), None)
        if free is None:
            return None
        live = Live(request, free, index=len(request.generated_token_ids))
        if self.last:
            live.text = TextStream(self.tokenizer, request.sampling.stop)
            live.text.prime(request.generated_token_ids)
        self.live[request.request_id] = live
        return live

    def _fail(self, live: Live, message: str) -> Emit:
        self.live.pop(live.request.request_id, None)
        return self._error(live.request, message)

    def _chunk(self, request_id: str, index: int, **fields: object) -> TokenChunk:
        return TokenChunk(
            request_id=request_id,
            index=index,
            epoch=self.epoch,
            device_id=self.task.device_id,
            ts=self.clock(),
            **fields,
        )

    def _error(self, request: GenerationRequest, message: str) -> Emit:
        index = len(request.generated_token_ids)
        return Emit(
            TokenChunk.failure(
                request.request_id,
                index,
                self.epoch,
                message,
                self.clock(),
                device_id=self.task.device_id,
            )
        )
