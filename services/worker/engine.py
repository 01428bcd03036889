"""One loaded shard and the requests passing through it — compute only, no I/O.

``ShardEngine`` turns what arrives (a ``GenerationRequest`` on the first shard, ``Frame``s on
the others, sampled tokens coming back to the first) into ``Send`` and ``Emit`` actions; the
worker service (service.py) does the publishing. The pipeline is a ring: the first shard embeds
the prompt and sends hidden states on, each shard runs its layers with a KV cache per request,
the last samples a token, streams it to the user and sends it back to the first shard for the
next step. A one-shard placement runs the ring inside one engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from libs.contracts import Frame, FrameKind, GenerationRequest, ShardTask, TokenChunk
from libs.contracts.frames import FINAL
from libs.models.decoding import Decoder, TextStream, sample
from libs.models.shard import ShardModel

#: Prompt rows per prefill frame: 256 × 576 floats ≈ 590 KB, under NATS' 1 MiB payload.
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class Send:
    device_id: str
    frame: Frame


@dataclass(frozen=True)
class Emit:
    chunk: TokenChunk


Action = Send | Emit


@dataclass
class Live:
    """One request's state on this shard."""

    request: GenerationRequest
    cache: DynamicCache
    position: int = 0  #: rows already in the KV cache
    index: int = 0  #: next token index (last shard)
    text: TextStream | None = None
    touched: float = field(default_factory=time.monotonic)


class ShardEngine:
    def __init__(
        self,
        model: ShardModel,
        task: ShardTask,
        route: tuple[str, ...],
        tokenizer: Decoder,
        stop_token_ids: frozenset[int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model = model
        self.task = task
        self.route = route
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.clock = clock
        self.live: dict[str, Live] = {}
        self.tokens = 0  #: tokens sampled here (last shard)
        self.context = int(getattr(model.config, "max_position_embeddings", 2048))

    @property
    def first(self) -> bool:
        return self.model.spec.first

    @property
    def last(self) -> bool:
        return self.model.spec.last

    @property
    def epoch(self) -> int:
        return self.task.epoch

    # -- entry points ---------------------------------------------------------------------------
    def begin(self, request: GenerationRequest) -> list[Action]:
        """First shard: a new request (or a re-run that continues after streamed tokens)."""
        ids = [*request.prompt_token_ids, *request.generated_token_ids]
        if len(ids) >= self.context:
            return [self._error(request, f"prompt of {len(ids)} tokens fills the context")]
        live = self._open(request)
        actions: list[Action] = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            rows = torch.tensor([ids[start : start + PREFILL_CHUNK]], dtype=torch.long)
            final = start + PREFILL_CHUNK >= len(ids)
            meta = request.model_dump_json().encode() if start == 0 else b""
            actions += self._run(live, rows, FrameKind.PREFILL, final, meta)
        return actions

    def on_frame(self, frame: Frame) -> list[Action]:
        if frame.kind == FrameKind.END:
            self.live.pop(frame.request_id, None)
            return []
        if frame.kind == FrameKind.TOKEN:
            live = self.live.get(frame.request_id)
            if live is None or not self.first or frame.position != live.position:
                return []  # finished or cancelled meanwhile, or from a run since replaced
            rows = torch.tensor([[frame.token]], dtype=torch.long)
            return self._run(live, rows, FrameKind.DECODE, True, b"")
        if frame.meta:
            live = self._open(GenerationRequest.model_validate_json(frame.meta))
        elif (found := self.live.get(frame.request_id)) is not None:
            live = found
            if frame.position != live.position:
                return []  # from a run of this request that was since started again
        else:
            return []
        rows = torch.frombuffer(bytearray(frame.data), dtype=torch.float32)
        rows = rows.reshape(1, *frame.shape)
        return self._run(live, rows, frame.kind, frame.final, frame.meta)

    def cancel(self, request_id: str) -> bool:
        return self.live.pop(request_id, None) is not None

    def expire(self, idle_s: float) -> list[str]:
        """Drop requests idle for ``idle_s`` (their END was lost); returns their ids."""
        cutoff = time.monotonic() - idle_s
        stale = [rid for rid, live in self.live.items() if live.touched < cutoff]
        for rid in stale:
            del self.live[rid]
        return stale

    # -- the work -------------------------------------------------------------------------------
    def _open(self, request: GenerationRequest) -> Live:
        live = Live(request, self.model.new_cache(), index=len(request.generated_token_ids))
        if self.last:
            live.text = TextStream(self.tokenizer, request.sampling.stop)
            live.text.prime(request.generated_token_ids)
        self.live[request.request_id] = live
        return live

    def _run(
        self, live: Live, rows: torch.Tensor, kind: FrameKind, final: bool, meta: bytes
    ) -> list[Action]:
        live.touched = time.monotonic()
        position = live.position
        out = self.model.forward(rows, live.cache)
        live.position += rows.shape[1]
        if not self.last:
            assert self.task.next_device_id is not None
            frame = Frame(
                kind,
                live.request.request_id,
                self.epoch,
                position=position,
                flags=FINAL if final else 0,
                meta=meta,
                dtype="float32",
                shape=tuple(out.shape[1:]),
                data=out[0].contiguous().numpy().tobytes(),
            )
            return [Send(self.task.next_device_id, frame)]
        return self._sample(live, out) if final else []

    def _sample(self, live: Live, logits: torch.Tensor) -> list[Action]:
        request, text = live.request, live.text
        assert text is not None
        rid = request.request_id
        token = sample(logits, request.sampling, rid, live.index)
        self.tokens += 1
        actions: list[Action] = []
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
            first = self.route[0]
            back = Frame(FrameKind.TOKEN, rid, self.epoch, position=live.position, token=token)
            return [*actions, Send(first, back)]
        self.live.pop(rid, None)
        done = self._chunk(
            rid,
            live.index,
            text=text.flush(),
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=live.index,
        )
        end = Frame(FrameKind.END, rid, self.epoch, meta=reason.encode())
        others = [Send(d, end) for d in self.route if d != self.task.device_id]
        return [*actions, Emit(done), *others]

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
