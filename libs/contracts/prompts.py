"""A request in the words of an engine that applies the model's own template (llama.cpp's).

The torch ring and vLLM take token ids the gateway made with the model's tokenizer. llama.cpp's
server applies the GGUF's own chat template, tool-call format and tokenizer, so any model it runs
answers in its own format: the gateway sends it the request as OpenAI's fields (``Prompt``),
and its pieces come back as text, whole tool calls and log-probabilities.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from libs.contracts.base import WireModel

#: The request's fields as OpenAI names them; the largest a NATS message carries comfortably.
MAX_BODY = 800_000


class Prompt(WireModel):
    """A chat (``messages``, ``tools``, ``response_format``…), a text completion
    (``prompt``…) or embeddings (``input``: a list of texts) as the JSON of OpenAI's
    request, already validated by the gateway.

    ``fields`` names the ones an engine may not honour (``tools``, ``response_format``,
    ``logprobs``…): an engine that serves only token ids refuses a request using any of them
    with the field's name (the user gets a 400), never drops it."""

    kind: Literal["chat", "text", "embed"]
    body: Annotated[str, Field(min_length=2, max_length=MAX_BODY)]
    fields: tuple[Annotated[str, Field(pattern=r"^[a-z_.]{1,64}$")], ...] = Field(
        default=(), max_length=32
    )


class ToolCall(WireModel):
    """One whole tool call (sent once complete: a migration never splits one)."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=200_000)]


class TopLogprob(WireModel):
    token: Annotated[str, Field(max_length=1024)]
    logprob: float
    bytes: tuple[Annotated[int, Field(ge=0, le=255)], ...] | None = None


class TokenLogprob(WireModel):
    """A sampled token's log-probability and the most likely alternatives."""

    token: Annotated[str, Field(max_length=1024)]
    logprob: float
    bytes: tuple[Annotated[int, Field(ge=0, le=255)], ...] | None = None
    top: tuple[TopLogprob, ...] = Field(default=(), max_length=20)


#: Why a stream ended: the model stopped, hit its limit, called tools, was cancelled, or failed.
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]
