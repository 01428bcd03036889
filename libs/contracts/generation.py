"""Generation messages: a prompt sent to a deployment's first shard (``GenerationRequest``, with
its ``Sampling``), one request's row of a batched step between shards (``StepRow``), the tokens
streamed back (``TokenChunk``) and the order to stop a request (``GenerationCancel``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from libs.contracts.base import DeploymentId, DeviceId, RequestId, Timestamp, WireModel
from libs.contracts.prompts import FinishReason, Prompt, TokenLogprob, ToolCall

Count = Annotated[int, Field(ge=0, le=10_000_000)]


class Sampling(WireModel):
    max_tokens: Annotated[int, Field(ge=1, le=32_768)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=4
    )
    seed: Annotated[int, Field(ge=0)] | None = None


class GenerationRequest(WireModel):
    """A prompt sent to the first shard of a deployment; tokens come back on the token subject."""

    request_id: RequestId
    deployment_id: DeploymentId
    epoch: Annotated[int, Field(ge=0)]
    #: The prompt's tokens (empty only when ``prompt`` carries the request as text).
    prompt_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    #: Tokens already streamed to the user: a re-run after migration continues after them.
    generated_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    sampling: Sampling = Sampling()
    ts: Timestamp
    #: The request as OpenAI's fields, for an engine that applies the model's own template
    #: (llama.cpp's); an engine of token ids uses ``prompt_token_ids`` and refuses it when it
    #: names a field that engine cannot honour.
    prompt: Prompt | None = None
    #: Pieces of ``prompt``'s answer the user already has: a re-run after migration runs it
    #: again with the same seed and sends only the pieces after them.
    delivered: Count = 0

    @model_validator(mode="after")
    def _some_prompt(self) -> GenerationRequest:
        if not self.prompt_token_ids and self.prompt is None:
            raise ValueError("a request needs prompt_token_ids or a prompt")
        return self


class StepRow(WireModel):
    """One request's part of a batched step between shards (a ``STEP`` frame's meta).

    ``kind`` is a ``FrameKind``: PREFILL (``rows`` prompt states from ``position``; ``final``
    on the prompt's last chunk; ``request`` on its first), DECODE (the newest token's state),
    TOKEN (the last shard's sampled ``token``, back to the first) or END (``reason``)."""

    request_id: RequestId
    kind: Annotated[int, Field(ge=1, le=4)]
    position: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    rows: Annotated[int, Field(ge=0, le=4096)] = 0
    final: bool = False
    token: Annotated[int, Field(ge=0)] | None = None
    request: GenerationRequest | None = None
    reason: Annotated[str, Field(max_length=64)] | None = None


class TokenChunk(WireModel):
    """One streamed token (``index`` counts from 0 per request) or the final chunk; for a
    ``prompt`` request, one piece (text, whole tool calls) with ``token_id`` None."""

    request_id: RequestId
    index: Count
    token_id: Annotated[int, Field(ge=0)] | None = None
    text: Annotated[str, Field(max_length=4096)] = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: Annotated[str, Field(max_length=2000)] | None = None
    #: With ``finish_reason`` error: the request's field the engine cannot honour (the user
    #: gets 400 naming it), or ``request`` for a request the engine found invalid.
    invalid: Annotated[str, Field(pattern=r"^[a-z_.]{1,64}$")] | None = None
    #: Tool calls, each whole (a ``prompt`` request's answer).
    tool_calls: tuple[ToolCall, ...] = Field(default=(), max_length=64)
    #: The piece's tokens' log-probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = Field(default=(), max_length=4096)
    #: An embeddings request's piece: one input's vector.
    embedding: tuple[float, ...] = Field(default=(), max_length=65536)
    #: On the final chunk of a ``prompt`` request a stop sequence ended: which one.
    stop_sequence: Annotated[str, Field(max_length=256)] | None = None
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    device_id: DeviceId | None = None
    #: The placement epoch that produced it: after a re-run the owner keeps only the new one.
    epoch: Annotated[int, Field(ge=0)] = 0
    ts: Timestamp

    @classmethod
    def failure(
        cls, request_id: str, index: int, epoch: int, message: str, ts: float, **fields: object
    ) -> TokenChunk:
        """The final chunk of a request that could not go on."""
        return cls(
            request_id=request_id,
            index=index,
            finished=True,
            finish_reason="error",
            error=message[:2000],
            epoch=epoch,
            ts=ts,
            **fields,
        )


class GenerationCancel(WireModel):
    """Stop one request on every shard of a deployment (the user went away)."""

    request_id: RequestId
    reason: Annotated[str, Field(min_length=1, max_length=200)] = "cancelled"
    ts: Timestamp
