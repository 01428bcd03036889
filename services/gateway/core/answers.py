"""One request's answer, whichever API asked for it: OpenAI's, Anthropic's or Ollama's.

Every API's request comes down to an ``Ask``: the chat's messages (or the text) as OpenAI's
fields, which an engine that applies the model's own template (llama.cpp's) reads, the token
ids of the gateway's tokenizer where it has one (the torch ring and vLLM read those), the
sampling, and ``n`` choices (one generation each). ``start`` places it and waits for the
first piece, so a request the serving engine cannot honour is answered 400 naming the field
before any byte of a stream leaves; ``Answer.items`` then yields every choice's pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Response

from libs.contracts import (
    DeploymentState,
    Prompt,
    Sampling,
    TokenChunk,
    TokenLogprob,
    ToolCall,
)
from libs.contracts.batch_requests import DEVICES_HEADER
from libs.contracts.prompts import MAX_BODY
from libs.models.chat import encode_chat
from services.gateway.core.completions import Completions, Slot
from services.gateway.core.errors import ApiError

log = logging.getLogger(__name__)
#: The most tokens one request may ask to generate, in every API.
MAX_TOKENS = 4096


@dataclass
class Ask:
    kind: Literal["chat", "text"]
    model: str
    #: OpenAI's request fields the engine of templates reads (messages or prompt, tools, …).
    body: dict[str, Any]
    #: The fields of ``body`` an engine of token ids cannot honour (it refuses them by name).
    fields: tuple[str, ...]
    sampling: Sampling
    n: int = 1
    #: For the gateway's tokenizer: the messages as role and text (chat), or the text.
    plain: list[dict[str, str]] | str = ""
    #: ``max_tokens`` is a ceiling to fit to the context (Anthropic's and Ollama's clients
    #: send large ones), not a number to refuse past it (OpenAI's).
    fit: bool = False


def sampling_for(
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    stop: tuple[str, ...],
    seed: int | None,
    default_max: int = 256,
) -> Sampling:
    """The request's sampling. A sampled (not greedy) request without a seed gets one drawn
    here: a generation re-run after a migration then repeats the pieces already streamed,
    which are skipped, rather than draw different ones (greedy stays greedy)."""
    if seed is None and temperature > 0:
        seed = random.randrange(2**31)
    return Sampling(
        max_tokens=max_tokens or min(default_max, MAX_TOKENS),
        temperature=temperature,
        top_p=top_p,
        stop=stop,
        seed=seed,
    )


@dataclass
class Choice:
    """One choice's answer gathered whole (a request that does not stream)."""

    index: int
    text: list[str] = field(default_factory=list)
    #: The devices its pieces came from.
    devices: set[str] = field(default_factory=set)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    #: The stop sequence that ended the text, where the engine names it.
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, chunk: TokenChunk) -> None:
        self.text.append(chunk.text)
        if chunk.device_id is not None:
            self.devices.add(chunk.device_id)
        self.tool_calls.extend(chunk.tool_calls)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stop_sequence = chunk.stop_sequence
            self.prompt_tokens = chunk.prompt_tokens or 0
            self.completion_tokens = chunk.completion_tokens or 0


def usage_of(choices: list[Choice]) -> dict[str, int]:
    """OpenAI's usage: the prompt counted once, every choice's completion tokens."""
    prompt = max((c.prompt_tokens for c in choices), default=0)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def served_by(choices: list[Choice], response: Response) -> None:
    """Name the devices that answered in ``DEVICES_HEADER`` (the Batch API keeps them)."""
    response.headers[DEVICES_HEADER] = ",".join(sorted(set().union(*(c.devices for c in choices))))


def refused(chunk: TokenChunk) -> ApiError:
    """The error a failed first chunk answers: 400 naming the field the engine cannot
    honour, or 503 (no capacity, the generation failed)."""
    message = chunk.error or "generation failed"
    if chunk.invalid is not None:
        param = None if chunk.invalid == "request" else chunk.invalid
        return ApiError(400, message, param=param, code="unsupported_field")
    return ApiError(503, message, "server_error", "no_capacity")


class Answer:
    """The running generations of one request, their pieces merged as (choice, chunk)."""

    def __init__(self, slot: Slot, n: int) -> None:
        self.slot, self.n = slot, n
        self.queue: asyncio.Queue[tuple[int, TokenChunk] | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.held: list[tuple[int, TokenChunk]] = []
        #: The prompt's length by the gateway's tokenizer (0: the engine counts it).
        self.prompt_tokens = 0

    def run(self, index: int, chunks: AsyncIterator[TokenChunk]) -> None:
        async def pump() -> None:
            try:
                async for chunk in chunks:
                    await self.queue.put((index, chunk))
            finally:
                await self.queue.put(None)

        self.tasks.append(asyncio.create_task(pump()))

    async def open(self) -> None:
        """Wait for the first piece; a failure there is raised as ``ApiError``. Cancelled
        meanwhile (a preempted batch request, a client gone): the generations are stopped and
        the slot given back."""
        try:
            item = await self.queue.get()
        except BaseException:
            await self.close()
            raise
        if item is None:
            await self.close()
            raise ApiError(503, "generation ended without a piece", "server_error")
        if item[1].finish_reason == "error":
            await self.close()
            raise refused(item[1])
        self.held.append(item)

    async def items(self) -> AsyncIterator[tuple[int, TokenChunk]]:
        """Every choice's pieces until each has finished; the slot is given back after."""
        try:
            for item in self.held:
                yield item
            ended = 0
            while ended < self.n:
                got = await self.queue.get()
                if got is None:
                    ended += 1
                    continue
                yield got
        finally:
            await self.close()

    async def collect(self) -> list[Choice]:
        """Every choice whole; 503 (or 400) if a generation failed."""
        choices = [Choice(i) for i in range(self.n)]
        async for index, chunk in self.items():
            if chunk.finish_reason == "error":
                raise refused(chunk)
            choices[index].add(chunk)
        return choices

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.slot.release()


async def prompt_ids(service: Completions, deployment: str, ask: Ask) -> list[int]:
    """The prompt's token ids by the gateway's tokenizer, for the engines that take ids;
    none for a model the gateway has no tokenizer of (llama.cpp tokenizes its own)."""
    try:
        tokenizer = await service.tokenizer(deployment)
    except Exception as exc:  # not a model the gateway's store knows: ids are not needed
        log.debug("no tokenizer", extra={"deployment": deployment, "error": repr(exc)})
        return []
    if isinstance(ask.plain, str):
        ids = [int(i) for i in tokenizer(ask.plain)["input_ids"]]
        return ids or [int(tokenizer.bos_token_id or 0)]
    return encode_chat(tokenizer, ask.plain)


async def start(service: Completions, ask: Ask, resolved: DeploymentState | None = None) -> Answer:
    """Place the request's generations and wait for the first piece (see the module);
    ``resolved``: the deployment its model means, where the API looked it up already."""
    resolved = resolved or await service.deployments.lookup(ask.model)
    deployment = resolved.deployment_id
    ids = await prompt_ids(service, deployment, ask)
    if ask.fit:
        room = resolved.context_length - len(ids)
        fitted = max(1, min(ask.sampling.max_tokens, room))
        ask.sampling = ask.sampling.model_copy(update={"max_tokens": fitted})
    if ids:
        service.check(deployment, len(ids), ask.sampling.max_tokens)
    body = json.dumps(ask.body)
    if len(body) > MAX_BODY:  # a NATS message carries it to the engine
        raise ApiError(413, f"the request's fields take more than {MAX_BODY} characters")
    prompt = Prompt(kind=ask.kind, body=body, fields=ask.fields)
    slot = service.admit()
    answer = Answer(slot, ask.n)
    answer.prompt_tokens = len(ids)
    for i in range(ask.n):
        sampling = ask.sampling
        if i and sampling.seed is not None and sampling.temperature > 0:
            sampling = sampling.model_copy(update={"seed": (sampling.seed + i) % 2**31})
        answer.run(i, service.chunks(deployment, ids, sampling, None, prompt))
    await answer.open()
    return answer
