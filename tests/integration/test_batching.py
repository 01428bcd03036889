"""Continuous batching in the shard engine: each request's tokens are those of its lone run.

The engine is driven directly (it is pure compute): requests of unlike lengths join and leave
a running batch, one is cancelled, a long prompt is prefilled in chunks beside running decodes,
and a split pipeline passes its step frames through the wire encoding. A batched int8 kernel
may round a row differently from a lone one: where a token differs, it must be a flipped near
tie (tests/ties.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from transformers import AutoTokenizer

from libs.contracts import GenerationRequest, Sampling, ShardTask, decode_frame, step_rows
from libs.models.chat import encode_chat
from libs.models.shipped import MODEL_NAME, prepare
from services.worker.torch.actions import Emit, Send
from services.worker.torch.shard import ShardModel, greedy
from services.worker.torch.shard_engine import PREFILL_BUDGET, ShardEngine
from tests.ties import assert_same_or_near_tie

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(prepare())


@pytest.fixture(scope="module")
def whole() -> ShardModel:
    return ShardModel(prepare(), 0, 30)


def task(start: int, end: int, index: int, route: tuple[str, ...]) -> ShardTask:
    nxt = route[index + 1] if index + 1 < len(route) else None
    return ShardTask(
        action="load",
        deployment_id="dep",
        model=MODEL_NAME,
        device_id=route[index],
        shard_index=index,
        shard_count=len(route),
        layer_start=start,
        layer_end=end,
        next_device_id=nxt,
        route=route,
        epoch=1,
        ts=time.time(),
    )


def request(rid: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        deployment_id="dep",
        epoch=1,
        prompt_token_ids=tuple(ids),
        sampling=Sampling(max_tokens=max_tokens),
        ts=time.time(),
    )


def prompts(tokenizer) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    def chat(text: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])

    long_text = " ".join(f"Item {i} is a small red box." for i in range(40))
    return {
        "short": chat("Hi."),
        "mid": chat("What is the capital of France?"),
        "long": chat(f"Summarise this list: {long_text}"),  # more rows than one step's budget
        "tail": chat("Name three colours."),
        "gone": chat("Write one sentence about the sea."),
    }


def tokens_of(actions: list, into: dict[str, list[int]], done: set[str]) -> None:  # type: ignore[type-arg]
    for action in actions:
        if isinstance(action, Emit):
            chunk = action.chunk
            assert chunk.error is None, chunk.error
            if chunk.token_id is not None:
                into.setdefault(chunk.request_id, []).append(chunk.token_id)
            if chunk.finished:
                done.add(chunk.request_id)


def test_requests_joining_and_leaving_a_batch_get_their_lone_runs_tokens(
    whole: ShardModel, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    ids = prompts(tokenizer)
    assert len(ids["long"]) > PREFILL_BUDGET
    stop = frozenset({tokenizer.eos_token_id})
    lone = {rid: greedy(whole, p, MAX_TOKENS, stop) for rid, p in ids.items()}
    engine = ShardEngine(whole, task(0, 30, 0, ("solo",)), ("solo",), tokenizer, stop, slots=8)
    got: dict[str, list[int]] = {}
    done: set[str] = set()
    sizes: list[int] = []

    def step() -> None:
        before = len(engine.live)
        tokens_of(engine.step(), got, done)
        sizes.append(before)

    engine.admit(request("short", ids["short"], max_tokens=6))  # leaves early
    engine.admit(request("mid", ids["mid"]))
    for _ in range(3):
        step()
    engine.admit(request("long", ids["long"]))  # joins mid-batch, prefilled in chunks
    engine.admit(request("gone", ids["gone"]))
    step()
    step()
    assert engine.cancel("gone")  # cancelled mid-stream: the others go on
    engine.admit(request("tail", ids["tail"]))
    while engine.ready:
        step()
    assert done == {"short", "mid", "long", "tail"}
    assert max(sizes) >= 4  # they really ran together
    assert_same_or_near_tie(whole, ids["short"], got["short"], lone["short"][:6])
    for rid in ("mid", "long", "tail"):
        assert_same_or_near_tie(whole, ids[rid], got[rid], lone[rid])
    assert 0 < len(got["gone"]) < len(lone["gone"]) and not engine.live


def test_requests_beyond_the_slots_wait_for_one_and_beyond_the_queue_are_refused(
    whole: ShardModel, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    ids = prompts(tokenizer)
    del ids["long"]
    stop = frozenset({tokenizer.eos_token_id})
    engine = ShardEngine(whole, task(0, 30, 0, ("solo",)), ("solo",), tokenizer, stop, slots=2)
    got: dict[str, list[int]] = {}
    done: set[str] = set()
    for rid, p in ids.items():  # 2 take the slots, 2 wait
        assert engine.admit(request(rid, p, max_tokens=8)) == []
    assert len(engine.live) == 2 and len(engine.waiting) == 2 and engine.full
    [refused] = engine.admit(request("more", ids["mid"]))
    assert isinstance(refused, Emit) and "busy" in (refused.chunk.error or "")
    assert engine.cancel(engine.waiting[-1].request_id)  # a waiting request can be cancelled
    while engine.ready:
        tokens_of(engine.step(), got, done)
    assert done == set(list(ids)[:3]) and not engine.waiting and not engine.live
    for rid in done:
        assert_same_or_near_tie(whole, ids[rid], got[rid], greedy(whole, ids[rid], 8, stop))


def run_pipeline(engines: list[ShardEngine], admitted: list[GenerationRequest]) -> Iterator[list]:  # type: ignore[type-arg]
    """Step a ring of engines in-process, each frame going through the wire encoding."""
    by_device = {e.task.device_id: e for e in engines}
    for r in admitted:
        engines[0].admit(r)
    while any(e.ready for e in engines):
        for engine in engines:
            if not engine.ready:
                continue
            actions = engine.step()
            yield actions
            for action in actions:
                if isinstance(action, Send):
                    frame = decode_frame(action.frame.encode())
                    by_device[action.device_id].receive(frame, step_rows(frame))


def test_a_batched_split_pipeline_matches_the_whole_model(whole: ShardModel, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompts(tokenizer)
    stop = frozenset({tokenizer.eos_token_id})
    route = ("a", "b", "c")
    bounds = ((0, 10), (10, 20), (20, 30))
    engines = [
        ShardEngine(ShardModel(prepare(), s, e), task(s, e, i, route), route, tokenizer, stop)
        for i, (s, e) in enumerate(bounds)
    ]
    got: dict[str, list[int]] = {}
    done: set[str] = set()
    frames_sent = 0
    for actions in run_pipeline(engines, [request(rid, p) for rid, p in ids.items()]):
        tokens_of(actions, got, done)
        frames_sent += sum(isinstance(a, Send) for a in actions)
    assert done == set(ids)
    per_request_steps = sum(len(t) for t in got.values()) * len(route)
    # A frame carries a micro-batch of rows (a third of the requests on a ring of three).
    assert frames_sent < per_request_steps * 0.75
    for rid, p in ids.items():
        assert_same_or_near_tie(whole, p, got[rid], greedy(whole, p, MAX_TOKENS, stop))
