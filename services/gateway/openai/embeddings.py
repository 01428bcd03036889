"""``/v1/embeddings``: each input's vector from the model's engine (llama.cpp's, mean-pooled).

The request travels like a generation (placed, sent to the deployment's first shard, followed
when it moves); its answer is a piece per input with its vector. An engine of token ids
refuses it, and the user gets 400 naming the model.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from libs.contracts import Prompt, Sampling
from services.gateway.core.answers import Answer, Choice
from services.gateway.core.completions import Completions
from services.gateway.core.errors import ApiError

Input = Annotated[str, Field(min_length=1, max_length=100_000)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    input: Input | Annotated[list[Input], Field(min_length=1, max_length=64)]
    encoding_format: Literal["float", "base64"] = "float"
    #: OpenAI's; the engines here give the model's own width only (refused when set).
    dimensions: Annotated[int, Field(ge=1, le=65536)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encoded(vector: tuple[float, ...], form: str) -> list[float] | str:
    """A vector as floats, or as OpenAI's base64 of little-endian float32."""
    if form == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embed(service: Completions, body: EmbeddingRequest) -> EmbeddingList:
    deployment = (await service.deployments.lookup(body.model)).deployment_id
    if body.dimensions is not None:
        message = "dimensions: the model's embeddings have their own width; omit dimensions"
        raise ApiError(400, message, param="dimensions", code="unsupported_field")
    prompt = Prompt(kind="embed", body=json.dumps({"input": body.inputs()}))
    answer = Answer(service.admit(), 1)
    answer.run(0, service.chunks(deployment, [], Sampling(max_tokens=1), None, prompt))
    await answer.open()
    vectors: list[tuple[float, ...]] = []
    whole = Choice(0)
    async for _, chunk in answer.items():
        if chunk.finish_reason == "error":
            raise ApiError(503, chunk.error or "failed", "server_error", "no_capacity")
        if chunk.embedding:
            vectors.append(chunk.embedding)
        whole.add(chunk)
    if len(vectors) != len(body.inputs()):
        raise ApiError(
            503, f"{len(vectors)} vectors for {len(body.inputs())} inputs", "server_error"
        )
    return EmbeddingList(
        data=[
            Embedding(index=i, embedding=encoded(v, body.encoding_format))
            for i, v in enumerate(vectors)
        ],
        model=body.model,
        usage=EmbeddingUsage(prompt_tokens=whole.prompt_tokens, total_tokens=whole.prompt_tokens),
    )
